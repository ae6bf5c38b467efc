"""The Trainer reads top to bottom (issue 28): checked on the source, every import
counted (function-local ones too).

* no import circle among the modules of ``meshtrain.trainer``;
* ``meshtrain.trainer`` imports nothing of ``meshtrain.jobs`` (``jobs.train`` builds on
  the Trainer, never the other way round);
* no module calls a private member of a Trainer it was handed (``trainer._x``), and no
  module writes an attribute onto one (``trainer.x = ...``): the Trainer's own class
  (trainer.py) is the only place that sets its state; its collaborators (the training
  loop, the evaluator, the saver) change it through its methods (``fire_event``,
  ``set_state``, ``set_control``, ``hand_back_model``).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
TRAINER = SRC / "meshtrain" / "trainer"


def _name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every meshtrain module ``path`` imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("meshtrain")}


def test_no_import_circle_inside_trainer() -> None:
    mods = {_name(p): p for p in TRAINER.rglob("*.py")}
    graph = {
        n: {m for m in _imports(p) if m in mods and m != n and m != "meshtrain.trainer"}
        for n, p in mods.items()
    }
    state: dict[str, int] = {}

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                raise AssertionError("import circle: " + " -> ".join([*stack, n, m]))
            if m not in state:
                visit(m, [*stack, n])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [])


def test_trainer_imports_nothing_of_jobs() -> None:
    bad = {
        _name(p): sorted(m for m in _imports(p) if m.startswith("meshtrain.jobs"))
        for p in TRAINER.rglob("*.py")
    }
    assert {k: v for k, v in bad.items() if v} == {}


def _trainer_uses(path: Path) -> tuple[list[str], list[str]]:
    """(private members read off a name ``trainer``, attributes written onto it)."""
    private, written = [], []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and getattr(sub.value, "id", None) == "trainer":
                    written.append(f"{path.name}:{sub.lineno} trainer.{sub.attr}")
        if (
            isinstance(node, ast.Attribute)
            and getattr(node.value, "id", None) == "trainer"
            and node.attr.startswith("_")
        ):
            private.append(f"{path.name}:{node.lineno} trainer.{node.attr}")
    return private, written


def test_no_module_reaches_into_a_trainer() -> None:
    private, written = [], []
    for path in (SRC / "meshtrain").rglob("*.py"):
        p, w = _trainer_uses(path)
        private += p
        written += w
    assert private == [], f"private Trainer members used from outside: {private}"
    assert written == [], f"attributes written onto a Trainer from outside: {written}"


def test_pipeline_training_is_one_interface() -> None:
    """The loop reaches pipeline parallelism through ``PipelineSteps`` only."""
    from meshtrain.trainer import pipeline_step

    assert {"train_window", "prediction_steps", "restore_user_model"} <= set(
        vars(pipeline_step.PipelineSteps)
    )
    loop = (TRAINER / "training_loop.py").read_text(encoding="utf-8")
    assert "pipeline_step" not in loop

"""House rules of the source tree, checked: small modules, no circle of imports, no
module-level mutable state.

* No module over 400 lines (one job per module).
* The graph of module-level imports between meshtrain modules has no cycle (imports
  inside functions are how optional and heavy pieces load lazily, and are allowed to
  point anywhere).
* No ``global`` statement, and a module-level name bound to a list, dict or set is a
  constant: UPPER_CASE (or ``__all__``), never rebound or mutated by the code.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "meshtrain").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _top_level_imports(name: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in tree.body:  # module level only; TYPE_CHECKING blocks are not run
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("meshtrain"):
                found.add(t)
    return found


def test_no_module_over_400_lines() -> None:
    long = {
        n: len(p.read_text(encoding="utf-8").splitlines())
        for n, p in _modules().items()
        if len(p.read_text(encoding="utf-8").splitlines()) > MAX_LINES
    }
    assert long == {}, f"split these modules (> {MAX_LINES} lines): {long}"


def test_no_import_cycles() -> None:
    mods = _modules()
    known = set(mods)
    graph = {n: _top_level_imports(n, p, known) for n, p in mods.items()}
    # a package's __init__ importing its own submodules is not a cycle through them
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in graph[n]:
            if n.startswith(m + ".") or m.startswith(n + "."):
                continue
            if state.get(m) == 1:
                cycle = stack[stack.index(m) :] + [m]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in graph:
        if n not in state:
            visit(n)


def test_no_module_level_mutable_state() -> None:
    problems = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                problems.append(f"{name}:{node.lineno} global {node.names}")
        for node in tree.body:
            if not isinstance(node, ast.Assign | ast.AnnAssign):
                continue
            value = node.value
            mutable = isinstance(value, ast.List | ast.Dict | ast.Set | ast.ListComp | ast.DictComp)
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
                mutable = mutable or value.func.id in ("dict", "list", "set", "defaultdict")
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and mutable:
                    if not (t.id.isupper() or t.id == "__all__" or t.id.lstrip("_").isupper()):
                        problems.append(f"{name}:{node.lineno} {t.id}")
    assert problems == [], f"module-level mutable state: {problems}"

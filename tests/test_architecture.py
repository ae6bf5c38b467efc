"""House rules of the source tree, checked: small modules, no circle of imports, no
module-level mutable state.

* No module over 400 lines (one job per module).
* The graph of imports between meshtrain modules has no cycle, counting the imports
  inside functions too: a lazy import still ties the two modules together, it only hides
  the circle from Python's import machinery (and from a reader).
* Neither has the graph of packages: each module collapsed to its top-level package under
  meshtrain (``meshtrain.models``, ``meshtrain.parallel``, ``meshtrain.config``; a
  top-level module such as ``meshtrain.deepspeed_zero`` is its own), function-local
  imports counted the same way; a remaining cycle is listed by name with why
  (``KNOWN_PACKAGE_TANGLES``).
* No ``global`` statement, and a module-level name bound to a list, dict or set is a
  constant: UPPER_CASE (or ``__all__``), and no code mutates it after import: not its own
  functions, not another module that imported it (a registry filled from elsewhere), and
  no ``globals()[...]`` writes.
* ``ruff check`` (with every rule a ``noqa`` comment names, and RUF100 against stale ones)
  and ``ruff format --check`` pass.
* No module-level function takes ``self``: a method kept outside its class.
* A file is replaced through ``files.atomic``; the few multi-path commits that rename by
  hand are listed with why (``RENAMES_ALLOWED``).
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


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every meshtrain module ``name`` imports, at module level or inside a function
    (``if TYPE_CHECKING:`` blocks are never run and do not count)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    unrun = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in unrun:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module
            if node.level:  # relative: resolve against this package
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                module = f"{base}.{module}" if module else base
            if not module:
                continue
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("meshtrain"):
                found.add(t)
    return found


def _tangles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected sets of more than one module (each holds a cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


# Import circles allowed by name (none: the trainer/ circle of issue 28 is gone). A new one
# fails the test; an entry whose circle is gone fails it too, until the entry is deleted.
KNOWN_TANGLES: list[frozenset[str]] = []


# A module over MAX_LINES is a smell to look at, not a number to split to (DESIGN.md: split
# where a module has two jobs). Each one is listed with the one job it holds, looked at, and
# its length then as a ceiling: a new long module, or one that grows past its ceiling, fails
# until someone looks again and splits it or updates the entry.
LONG_MODULES: dict[str, tuple[int, str]] = {
    "meshtrain.data.prepare_store": (
        402,
        "tokenizing inputs into a store in one pass: reading, hashing, the worker pool and "
        "writing in input order; the pool forks with the heap frozen (+3 lines, the fork "
        "hang of session 22)",
    ),
    "meshtrain.engine.engine": (
        544,
        "the Engine: one training step and its DeepSpeed-facing members; checkpoint, "
        "async-save and pre-emption members only delegate to checkpoint/ and preemption.py, "
        "and what p.grad holds (DeepSpeed's, the Accelerator's) is visible_grads.py's, "
        "called once at the boundary backward (+6 lines, issue 27); MoE's expert load and "
        "the activation estimate are attached to the step log like MFU; between_steps "
        "keeps an evaluation out of the step's own measurement, whose marks live here "
        "(+8 lines, issue 49); the first step ends the first-step collective timeout "
        "(+5 lines, issue 47); reassigned parameters (LocalSGD's param.data) are taken "
        "back by parallel/zero/rebound.py, called before forward, step and save (+4 lines, "
        "issue 50); the step log is handed the heartbeat's stragglers (+1 line, issue 47); "
        "save_weights, the member users call to write weights from the ranks, delegates to "
        "pretrained_shards.py (between_steps: its bytes are not a step's), and "
        "save_16bit_model's safetensors name goes there (+31 lines, issue 46); the "
        "accumulation window's driver is window.py's, train_batch / eval_batch are "
        "batches.py's, the gradients' scale the ZeRO stage's (-12 lines, issue 45); backward "
        "takes the loss's weight in the step's gradient, documented, and the step log "
        "records what the weighted loss counts for (+9 lines, issue 45; 535 before it)",
    ),
    "meshtrain.distributed.ledger": (
        421,
        "the collective ledger: its ring buffer, its records and their publication, and the "
        "watchdog that reads it (heartbeats, silence verdicts and store I/O live in their "
        "own modules); its timeout can change after the first step (issue 47); it answers the "
        "heartbeat's question of which collectives are in flight, whose waits stragglers.py "
        "judges (+16 lines, issue 47)",
    ),
    "meshtrain.parallel.zero.flat_group": (
        408,
        "one param group's flat buffers, buckets and master chunks (its packing lives in "
        "packing.py, its master layouts in master_layout.py)",
    ),
    "meshtrain.parallel.zero.part": (
        406,
        "one kind of parameters over its replica group: the per-backward lifecycle its "
        "stage drives (reductions, landing a split backward's gradients, gathers)",
    ),
    "meshtrain.parallel.zero.stage": (
        430,
        "the ZeRO stage the Engine, the Accelerator and the pipeline call: its parts' "
        "lifecycle and the whole gradient contract between backward and step (average, "
        "full gradient, norm, clip, the scale carried), with the expert math in its "
        "docstring; one part's storage and reduction are part.py's (issue 45)",
    ),
    "meshtrain.trainer.trainer": (
        529,
        "the Trainer class: transformers' public methods, each delegating to the module of "
        "its job (setup, loss, evaluation, results, saving, the loop); the mixins became "
        "collaborators it holds (loop, evaluator, saver), so its thin delegates, the "
        "per-batch hooks users override (compute_loss, training_step, prediction_step) "
        "and the methods the collaborators change it through live here (+109 lines, "
        "issue 45)",
    ),
    "meshtrain.trainer.training_loop": (
        424,
        "TrainingLoop: train() top to bottom and what it calls per step (the window of "
        "micro-batches, logging, evaluation and best model, checkpoints, pre-emption, the "
        "end); the window moved here from trainer.py when the mixin became a collaborator "
        "(issue 45)",
    ),
    "meshtrain.interop.dcp_source": (
        433,
        "a DCP folder as the engine loader's source: its files checked, its keys mapped to "
        "the model's names, and reads by element range (any chunk box through read, whole-"
        "row blocks straight into the master through read_into; issue 46)",
    ),
    "meshtrain.trainer.arguments": (
        432,
        "TrainingArguments: transformers' fields, each checked (value checks live in "
        "checks.py), and their engine config; include_for_metrics (+10 lines, issue 44)",
    ),
}


def test_long_modules_are_looked_at() -> None:
    sizes = {n: len(p.read_text(encoding="utf-8").splitlines()) for n, p in _modules().items()}
    unlooked = {n: k for n, k in sizes.items() if k > MAX_LINES and n not in LONG_MODULES}
    assert unlooked == {}, (
        f"modules over {MAX_LINES} lines: split where they hold two jobs, or list the one "
        f"job in LONG_MODULES: {unlooked}"
    )
    grown = {
        n: (sizes.get(n), cap) for n, (cap, _) in LONG_MODULES.items() if sizes.get(n, 0) > cap
    }
    assert grown == {}, f"grew past the length they were looked at: {grown}"
    gone = [n for n in LONG_MODULES if sizes.get(n, 0) <= MAX_LINES]
    assert gone == [], f"no longer long (or gone): delete from LONG_MODULES: {gone}"


def test_no_import_cycles() -> None:
    mods = _modules()
    known = set(mods)
    graph = {
        n: {
            m
            for m in _imports(n, p, known)
            # a package's __init__ importing its own submodules is not a cycle through them
            if not (n.startswith(m + ".") or m.startswith(n + "."))
        }
        for n, p in mods.items()
    }
    tangles = _tangles(graph)
    new = [sorted(t) for t in tangles if t not in KNOWN_TANGLES]
    assert new == [], f"import cycles (function-local imports count): {new}"
    gone = [sorted(t) for t in KNOWN_TANGLES if t not in tangles]
    assert gone == [], (
        f"these tangles are gone (or changed): delete them from KNOWN_TANGLES: {gone}"
    )


def _package(module: str) -> str:
    """``meshtrain.parallel.tensor.plans`` -> ``meshtrain.parallel``; the root stays itself."""
    return ".".join(module.split(".")[:2])


def package_graph() -> dict[str, set[str]]:
    """Imports between meshtrain's top-level packages (module docstring), each edge once."""
    mods = _modules()
    known = set(mods)
    graph: dict[str, set[str]] = {_package(n): set() for n in mods}
    for n, p in mods.items():
        graph[_package(n)] |= {_package(m) for m in _imports(n, p, known)} - {_package(n)}
    return graph


# Package cycles allowed by name, with why (none: the one that joined config,
# deepspeed_zero, models and parallel went with issue 45 step 3, once parallel/ stopped
# importing the reference models). A new one fails the test; so does an entry whose cycle
# is gone, until the entry is deleted.
KNOWN_PACKAGE_TANGLES: dict[frozenset[str], str] = {}


def test_no_package_cycles() -> None:
    tangles = _tangles(package_graph())
    new = [sorted(t) for t in tangles if t not in KNOWN_PACKAGE_TANGLES]
    assert new == [], f"package cycles (function-local imports count): {new}"
    gone = [sorted(t) for t in KNOWN_PACKAGE_TANGLES if t not in tangles]
    assert gone == [], (
        f"these package cycles are gone: delete them from KNOWN_PACKAGE_TANGLES: {gone}"
    )


def test_the_package_check_collapses_modules_and_sees_lazy_imports() -> None:
    """Modules fold into their top-level package, and the edges the module check sees
    (a function-local import included) are the package graph's: parallel/ reaches
    families/ through module-level imports, models/ reaches deepspeed_zero only through
    the import inside ``Decoder.reset_parameters``."""
    assert _package("meshtrain.parallel.tensor.plans") == "meshtrain.parallel"
    assert _package("meshtrain.deepspeed_zero") == "meshtrain.deepspeed_zero"
    assert _package("meshtrain") == "meshtrain"
    graph = package_graph()
    assert "meshtrain.families" in graph["meshtrain.parallel"]
    assert "meshtrain.deepspeed_zero" in graph["meshtrain.models"]
    assert "meshtrain.models" not in graph["meshtrain.parallel"]
    assert _tangles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [frozenset({"a", "b", "c"})]


def test_the_cycle_check_sees_function_local_imports() -> None:
    """The check would catch a circle closed by a lazy import (the shape it used to miss)."""
    graph = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert _tangles(graph) == [frozenset({"a", "b"})]
    mods = _modules()
    lazy = _imports("meshtrain.engine.engine", mods["meshtrain.engine.engine"], set(mods))
    assert "meshtrain.parallel.pipeline.engine_step" in lazy  # imported inside a method


_MUTATORS = {
    "append", "extend", "insert", "pop", "popitem", "remove", "clear", "update",
    "setdefault", "add", "discard", "sort", "reverse", "appendleft", "extendleft", "popleft",
    "difference_update", "intersection_update", "symmetric_difference_update",
    "__setitem__", "__delitem__",
}  # fmt: skip
_CONTAINERS = {"dict", "list", "set", "defaultdict", "deque", "OrderedDict", "Counter", "bytearray"}
# A process-pool worker's own inputs, set once by the pool's initializer inside each worker
# process (never in a training process): the one place a module container is written.
WORKER_STATE = {("meshtrain.data.prepare_store", "_WORKER")}


def _containers(tree: ast.Module) -> set[str]:
    """Module-level names bound to a list, dict or set (literal, comprehension or call)."""
    out = set()
    for node in tree.body:
        if not isinstance(node, ast.Assign | ast.AnnAssign) or node.value is None:
            continue
        value = node.value
        mutable = isinstance(value, ast.List | ast.Dict | ast.Set | ast.ListComp | ast.DictComp)
        mutable = mutable or isinstance(value, ast.SetComp)
        if isinstance(value, ast.Call):
            f = value.func
            called = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
            mutable = mutable or called in _CONTAINERS
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        out |= {t.id for t in targets if isinstance(t, ast.Name) and mutable}
    return out


def _base_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _mutations(name: str, tree: ast.Module, owned: dict[str, set[str]]) -> list[str]:
    """Where ``tree`` mutates a module container: its own from inside a function, or one it
    imported from another module anywhere; and every ``globals()[...]`` write."""
    imported = {
        (a.asname or a.name): f"{node.module}.{a.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module in owned
        for a in node.names
        if a.name in owned[node.module]
    }
    found = []

    def check(node: ast.AST, in_function: bool) -> None:
        watched = (owned[name] if in_function else set()) | set(imported)
        hits = []
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            hits += [_base_name(t) for t in targets if isinstance(t, ast.Subscript)]
            for t in targets:
                call = t.value if isinstance(t, ast.Subscript) else None
                if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "globals":
                    found.append(f"{name}:{node.lineno} globals()[...] written")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in _MUTATORS:
                hits.append(_base_name(node.func.value))
        for h in hits:
            if h in watched and (name, h) not in WORKER_STATE:
                found.append(f"{name}:{node.lineno} mutates {imported.get(h, f'{name}.{h}')}")

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            check(child, inner)
            visit(child, inner)

    visit(tree, False)
    return found


def test_no_module_level_mutable_state() -> None:
    problems = []
    trees = {n: ast.parse(p.read_text(encoding="utf-8")) for n, p in _modules().items()}
    owned = {n: _containers(t) for n, t in trees.items()}
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                problems.append(f"{name}:{node.lineno} global {node.names}")
        for t in owned[name]:
            if not (t.isupper() or t == "__all__" or t.lstrip("_").isupper()):
                problems.append(f"{name}: {t} (a module-level container must be a constant)")
        problems += _mutations(name, tree, owned)
    assert problems == [], f"module-level mutable state: {problems}"


def test_the_state_check_sees_a_registry_filled_from_elsewhere() -> None:
    """The shape the UPPER_CASE rule let through (``SECTION_PATHS.update(...)`` in another
    module) and a function appending to its own module's list are both caught."""
    owner = ast.parse("REGISTRY = {}\nITEMS = []\ndef f():\n    ITEMS.append(1)\n")
    user = ast.parse("from pkg.owner import REGISTRY\nREGISTRY.update({int: 'x'})\n")
    cache = ast.parse("def g(v):\n    globals()['x'] = v\n")
    owned = {"pkg.owner": _containers(owner), "pkg.user": set(), "pkg.cache": set()}
    assert _mutations("pkg.owner", owner, owned) == ["pkg.owner:4 mutates pkg.owner.ITEMS"]
    assert _mutations("pkg.user", user, owned) == ["pkg.user:2 mutates pkg.owner.REGISTRY"]
    assert _mutations("pkg.cache", cache, owned) == ["pkg.cache:2 globals()[...] written"]


def test_ruff_passes_with_the_rules_the_noqa_comments_name() -> None:
    """The lint rules in pyproject.toml (those the code's ``noqa`` comments name, and RUF100,
    which flags a ``noqa`` that suppresses nothing) and the formatter hold on the tree."""
    import shutil
    import subprocess

    import pytest

    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]' brings it)")
    root = Path(__file__).resolve().parents[1]
    for argv in ([ruff, "check", "src", "tests"], [ruff, "format", "--check", "src", "tests"]):
        run = subprocess.run(argv, cwd=root, capture_output=True, text=True)
        assert run.returncode == 0, f"{' '.join(argv[1:])}:\n{run.stdout[-3000:]}{run.stderr}"


def _self_taking_functions(name: str, source: str) -> list[str]:
    """Module-level functions whose first parameter is ``self``: a method living outside its
    class (a split made to meet a line count), reading the object's insides from afar."""
    tree = ast.parse(source)
    return [
        f"{name}:{node.lineno} {node.name}(self, ...)"
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.args.args
        and node.args.args[0].arg == "self"
    ]


def test_no_free_function_takes_self() -> None:
    found = [
        hit
        for name, path in _modules().items()
        for hit in _self_taking_functions(name, path.read_text(encoding="utf-8"))
    ]
    assert found == [], (
        f"free functions taking self (make them methods or name the object): {found}"
    )


def test_the_self_check_sees_a_free_function_taking_self() -> None:
    source = "def spans(self, bucket):\n    return self.layout\n\nclass A:\n    def f(self): ...\n"
    assert _self_taking_functions("pkg.mod", source) == ["pkg.mod:1 spans(self, ...)"]


# Where a rename stays hand-written, and why: each is a commit of several paths at once (a
# checkpoint folder and its old copy, a token store's files), not one file's replacement,
# which is files/atomic.py's job (write_atomic, atomic_file, atomic_path).
RENAMES_ALLOWED = {
    "meshtrain.files.atomic": "the one way a file or folder is replaced",
    "meshtrain.checkpoint.writer": "a checkpoint folder's commit: the old tag aside, the new in",
    "meshtrain.checkpoint.storage": "a crashed commit rolled back, a tag moved aside to delete",
    "meshtrain.interop.dcp_writer": "a DCP folder's commit, as the checkpoint writer's",
    "meshtrain.data.layout": "a token store's files committed together, the meta last",
    "meshtrain.trainer.checkpoints": "a checkpoint-<step> folder moved aside to delete",
}


def _renames(name: str, source: str) -> list[str]:
    """Calls of ``os.replace`` / ``os.rename`` / ``Path.rename`` / ``Path.replace`` (with
    one argument: ``str.replace`` takes two)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        attr, base = node.func.attr, node.func.value
        is_os = isinstance(base, ast.Name) and base.id == "os" and attr in ("replace", "rename")
        is_path = attr in ("replace", "rename") and len(node.args) == 1 and not node.keywords
        if is_os or (is_path and not isinstance(base, ast.Constant)):
            out.append(f"{name}:{node.lineno} {attr}")
    return out


def test_files_are_replaced_through_files_atomic() -> None:
    """A file meshtrain writes is replaced by ``files.atomic`` (temp name, fsync, rename,
    fsync of the folder), not by a hand-rolled temp file and ``os.replace``."""
    found = [
        hit
        for name, path in _modules().items()
        if name not in RENAMES_ALLOWED
        for hit in _renames(name, path.read_text(encoding="utf-8"))
    ]
    assert found == [], f"hand-rolled renames (use meshtrain.files.atomic): {found}"


def test_the_rename_check_sees_a_hand_rolled_replace() -> None:
    source = "import os\ndef f(tmp, p):\n    os.replace(tmp, p)\n    p.rename(tmp)\n    'a'.replace('a', 'b')\n"
    assert _renames("pkg.mod", source) == ["pkg.mod:3 replace", "pkg.mod:4 rename"]


# ZeRO's gradient storage, by the attribute names FlatGroup gives it: only parallel/zero
# reads or writes it; everyone else calls the stage's contract (parallel/zero/stage.py:
# average_, grad_scale, full_grad, grad_norm, clip_, ...), issue 45.
ZERO_BUFFERS = {"grad_chunks", "grad_views", "grad_flat", "grad_shard"}
ZERO_PACKAGE = "meshtrain.parallel.zero"


def _zero_guesses(name: str, source: str) -> list[str]:
    """Reads of ZeRO's gradient buffers (``x.grad_chunks``, ...) and guesses at the shape of
    the stage (``getattr(zero, "parts", ...)``: the stage is always a composite)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ZERO_BUFFERS:
            out.append(f"{name}:{node.lineno} .{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == "parts"
        ):
            out.append(f'{name}:{node.lineno} {node.func.id}(..., "parts")')
    return out


def test_zero_owns_its_gradient_buffers() -> None:
    found = [
        hit
        for name, path in _modules().items()
        if name != ZERO_PACKAGE and not name.startswith(ZERO_PACKAGE + ".")
        for hit in _zero_guesses(name, path.read_text(encoding="utf-8"))
    ]
    assert found == [], (
        f"ZeRO's gradient buffers read outside parallel/zero, or the stage's shape guessed "
        f"(call the ZeroStage contract instead): {found}"
    )


def test_the_buffer_check_sees_a_read_and_a_guess() -> None:
    source = (
        "def f(zero, g):\n    for c in g.grad_chunks:\n        c.mul_(2)\n"
        "    return getattr(zero, 'parts', None), g.grad_views.items(), g.grad_norm\n"
    )
    assert _zero_guesses("pkg.mod", source) == [
        "pkg.mod:2 .grad_chunks",
        'pkg.mod:4 getattr(..., "parts")',
        "pkg.mod:4 .grad_views",
    ]


# The accumulation window's one driver (issue 45): only engine/window.py calls the ZeRO
# stage's per-backward lifecycle; the Engine, the Accelerator and the pipeline go through it.
WINDOW_CALLS = {"begin_window", "before_backward", "after_backward", "average_", "loss_multiplier"}
WINDOW_DRIVER = "meshtrain.engine.window"


def _window_calls(name: str, source: str) -> list[str]:
    """Calls ``<...>.zero.<lifecycle>(...)`` or ``zero.<lifecycle>(...)``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        base = node.func.value
        on_zero = (isinstance(base, ast.Name) and base.id == "zero") or (
            isinstance(base, ast.Attribute) and base.attr == "zero"
        )
        if on_zero and node.func.attr in WINDOW_CALLS:
            out.append(f"{name}:{node.lineno} zero.{node.func.attr}")
    return out


def test_one_driver_runs_the_accumulation_window() -> None:
    found = [
        hit
        for name, path in _modules().items()
        if name != WINDOW_DRIVER and not name.startswith(ZERO_PACKAGE + ".")
        for hit in _window_calls(name, path.read_text(encoding="utf-8"))
    ]
    assert found == [], (
        f"the ZeRO window lifecycle called outside engine/window.py (call engine.window): {found}"
    )


def test_the_window_check_sees_a_second_driver() -> None:
    source = "def f(engine, zero):\n    engine.zero.begin_window()\n    zero.average_()\n"
    assert _window_calls("pkg.mod", source) == [
        "pkg.mod:2 zero.begin_window",
        "pkg.mod:3 zero.average_",
    ]


# No private name used across modules (issue 45): a leading-underscore function, method or
# attribute of a meshtrain module is that module's. Third-party privates that meshtrain
# must read (torch keeps no public handle on them) are listed with why.
THIRD_PARTY_PRIVATES = {
    "_buffers": "torch nn.Module's buffer dict (placement moves buffers in place)",
    "_timeout": "gloo's ProcessGroup options (a live group's timeout is set there)",
    "_world": "torch.distributed_c10d's world state (the groups a timeout applies to)",
}


def _owned_privates(tree: ast.AST) -> set[str]:
    """Private names a module owns: set on ``self``/``cls``, or defined as a function."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in ("self", "cls") and _private(node.attr):
                out.add(node.attr)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _private(node.name):
            out.add(node.name)
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(name: str, tree: ast.AST, owners: dict[str, set[str]]) -> list[str]:
    """``from meshtrain... import _x``, and ``obj._x`` (obj not self/cls) where ``_x`` is
    another meshtrain module's private and not a listed third-party one."""
    out = []
    # a module's own privates, on any object of its classes (``ledger._rank`` in ledger.py);
    # the price: a module reading another's private of the same name is not seen
    mine = _owned_privates(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("meshtrain"):
            out += [f"{name}:{node.lineno} import {a.name}" for a in node.names if _private(a.name)]
        if isinstance(node, ast.Attribute) and _private(node.attr):
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            theirs = owners.get(node.attr, set()) - {name}
            if not own and theirs and node.attr not in mine | THIRD_PARTY_PRIVATES.keys():
                out.append(f"{name}:{node.lineno} .{node.attr} (of {sorted(theirs)[0]})")
    return out


def test_no_private_name_crosses_modules() -> None:
    trees = {n: ast.parse(p.read_text(encoding="utf-8")) for n, p in _modules().items()}
    owners: dict[str, set[str]] = {}
    for n, tree in trees.items():
        for attr in _owned_privates(tree):
            owners.setdefault(attr, set()).add(n)
    found = [hit for n, tree in trees.items() for hit in _private_uses(n, tree, owners)]
    assert found == [], f"private names used outside their module (make them public): {found}"


def test_the_private_check_sees_an_import_and_an_attribute() -> None:
    owner = ast.parse("class W:\n    def __init__(self):\n        self._queue = []\n")
    user = ast.parse("from meshtrain.a import _f\n\ndef g(w):\n    w._queue.append(1)\n")
    owners = {attr: {"pkg.owner"} for attr in _owned_privates(owner)}
    assert _private_uses("pkg.user", user, owners) == [
        "pkg.user:1 import _f",
        "pkg.user:4 ._queue (of pkg.owner)",
    ]

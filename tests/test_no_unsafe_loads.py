"""No load path in meshtrain unpickles: checkpoints are safetensors + JSON (issue 18).

A pickle (``pickle.load``, ``torch.load`` without ``weights_only=True``, ``np.load`` with
``allow_pickle=True``) runs code from the file it reads; a checkpoint or data file from
elsewhere must never be able to do that. The allowed uses are ``pickle.loads`` of what a
process's own children send it over a pipe (no file): ``launch/processes.py`` (results)
and ``serve/model_side.py`` (a round trip of an exception about to be sent to the
forked HTTP process, to check that it survives the pipe). One restricted unpickler:
``interop/dcp_metadata.py`` reads torch DCP's ``.metadata`` (a pickle by DCP's design)
with a ``find_class`` that answers only DCP's metadata dataclasses, ``torch.Size``, torch
dtypes and layouts and a path, and refuses every other name (os.system among them) by name.
"""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "meshtrain"
ALLOWED = {
    ("launch/processes.py", "pickle.loads"),
    ("serve/model_side.py", "pickle.loads"),
    # a DCP .metadata: an Unpickler whose find_class answers only 13 DCP metadata names
    ("interop/dcp_metadata.py", "Unpickler"),
}
PATTERNS = {
    "pickle.load": re.compile(r"\bpickle\.loads?\("),
    "pickle.loads": re.compile(r"\bpickle\.loads\("),
    "cPickle/dill/joblib": re.compile(r"\b(cPickle|dill|joblib)\.load"),
    "torch.load": re.compile(r"\btorch\.load\((?![^)]*weights_only\s*=\s*True)"),
    "np.load pickle": re.compile(r"allow_pickle\s*=\s*True"),
    "Unpickler": re.compile(r"\bUnpickler\b"),
}


def test_no_load_path_unpickles():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for name, pattern in PATTERNS.items():
                if pattern.search(code):
                    kind = "pickle.loads" if "pickle.loads(" in code else name
                    if (rel, kind) not in ALLOWED:
                        found.append(f"{rel}:{n}: {name}: {line.strip()}")
    assert not found, "unsafe loads:\n" + "\n".join(found)


def test_the_grep_catches_what_it_should():
    bad = [
        "x = pickle.load(f)",
        "state = torch.load(path)",
        "state = torch.load(path, weights_only=False)",
        "a = np.load(p, allow_pickle=True)",
    ]
    ok = ["state = torch.load(path, weights_only=True)", "pickle.dumps(x)"]
    hits = lambda s: any(p.search(s) for p in PATTERNS.values())  # noqa: E731
    assert all(hits(s) for s in bad) and not any(hits(s) for s in ok)

"""Corruption campaign: damage one artifact file at a time and demand that loading names it.

    python -m tests.faults.corruption [--trials 100] [--seed 0] [--json OUT]

Artifacts (built once, copied fresh for every trial):

* a 2-rank checkpoint, tags ``t1`` and ``t2`` (real gloo ranks, ``save_shards``); ``t2`` is
  damaged: ``manifest.json``, ``rank00000.safetensors``, ``rank00001.safetensors``;
* a token store (``prepare``, byte tokenizer): ``meta.json``, ``tokens.bin``,
  ``offsets.bin``, ``labels.bin``;
* a consolidated export folder of ``t2``: ``model.safetensors``,
  ``meshtrain_checksums.json``.

Each trial picks one of those files and either flips one byte at a random position (XOR with
a random non-zero value) or truncates it to a random length. Then all three artifacts are
loaded completely (every tensor and state of ``t2`` through ``CheckpointReader``, every
document of the store through ``TokenStore``, the export through ``check_folder`` then
``safetensors.load_file``). A trial passes when the damaged artifact raises a
``MeshtrainError`` whose message names the damaged file, and both undamaged artifacts load
and equal their pristine content.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

CKPT_FILES = (
    "ckpt/t2/manifest.json",
    "ckpt/t2/rank00000.safetensors",
    "ckpt/t2/rank00001.safetensors",
)
STORE_FILES = ("store/meta.json", "store/tokens.bin", "store/offsets.bin", "store/labels.bin")
EXPORT_FILES = ("export/model.safetensors", "export/meshtrain_checksums.json")
FILES = CKPT_FILES + STORE_FILES + EXPORT_FILES


def save_two_tags(save_dir: str) -> None:
    """Run on 2 gloo ranks: checkpoints ``t1`` and ``t2`` of the hand-made shards."""
    from tests.checkpoint.ranks import _save, _world

    group = _world()
    _save(save_dir, "t1", group, seed=1)
    _save(save_dir, "t2", group, seed=2)


def build(root: Path) -> None:
    """The pristine artifacts under ``root`` (spawns 2 ranks once)."""
    from meshtrain.checkpoint.consolidate import consolidate
    from meshtrain.data import prepare
    from tests.harness import run_ranks

    run_ranks(save_two_tags, 2, str(root / "ckpt"))
    rows = [
        json.dumps({"text": f"row {i} " + "abc" * (i % 17), "label": i % 3}) for i in range(300)
    ]
    (root / "rows.jsonl").write_text("\n".join(rows) + "\n")
    prepare(root / "rows.jsonl", "byte", root / "store", label_field="label", workers=1)
    consolidate(root / "ckpt", root / "export", tag="t2")


def load_checkpoint(root: Path) -> dict:
    from meshtrain.checkpoint import CheckpointReader

    out = {}
    with CheckpointReader(root / "ckpt", "t2") as r:
        for state in r.states():
            for name in r.names(state):
                out[(name, state)] = r.read(name, state)
        for rank in range(r.world_size):
            out[("state", rank)] = json.dumps(r.rank_state(rank), sort_keys=True)
            out[("rng", rank)] = r.rank_tensor(rank, "rng.torch")
        out["meta"] = json.dumps(r.meta, sort_keys=True)
    return out


def load_store(root: Path) -> dict:
    from meshtrain.data.store import TokenStore

    s = TokenStore(root / "store")
    out = {i: s.doc(i) for i in range(len(s))}
    out["labels"] = [s.label(i) for i in range(len(s))]
    return out


def load_export(root: Path) -> dict:
    from safetensors.torch import load_file

    from meshtrain.checkpoint.tensor_files import check_folder
    from meshtrain.errors import CheckpointError

    check_folder(root / "export", CheckpointError)
    return load_file(root / "export" / "model.safetensors")


LOADERS = {"ckpt": load_checkpoint, "store": load_store, "export": load_export}


def _same(a, b) -> bool:
    import numpy as np
    import torch

    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif isinstance(x, np.ndarray):
            if not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return True


def damage(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    if rng.random() < 0.7 and data:
        pos = rng.randrange(len(data))
        data[pos] ^= rng.randrange(1, 256)
        path.write_bytes(bytes(data))
        return f"flip byte {pos} of {len(data)}"
    keep = rng.randrange(len(data)) if data else 0
    path.write_bytes(bytes(data[:keep]))
    return f"truncate {len(data)} -> {keep} bytes"


def run(
    trials: int = 100, seed: int = 0, work: Path | None = None, files: tuple = FILES
) -> list[dict]:
    """``trials`` trials, each damaging one of ``files`` (all of them by default)."""
    from meshtrain.errors import MeshtrainError

    rng = random.Random(seed)
    tmp = Path(work or tempfile.mkdtemp(prefix="meshtrain-corruption-"))
    pristine = tmp / "pristine"
    build(pristine)
    expected = {k: f(pristine) for k, f in LOADERS.items()}
    results = []
    for trial in range(trials):
        case = tmp / "case"
        shutil.rmtree(case, ignore_errors=True)
        shutil.copytree(pristine, case)
        rel = rng.choice(files)
        target = case / rel
        how = damage(target, rng)
        row = {"trial": trial, "file": rel, "damage": how, "detected": False, "named": False,
               "others_load": True, "error": ""}  # fmt: skip
        for kind, loader in LOADERS.items():
            damaged = rel.startswith(kind + "/")
            try:
                got = loader(case)
            except MeshtrainError as exc:
                if damaged:
                    row["detected"], row["error"] = True, str(exc)
                    row["named"] = str(target) in str(exc)
                else:
                    row["others_load"], row["error"] = False, f"{kind}: {exc}"
                continue
            if not damaged and not _same(got, expected[kind]):
                row["others_load"] = False
            if damaged:
                row["error"] = "loaded without error" + (
                    "" if not _same(got, expected[kind]) else " (content unchanged)"
                )
        results.append(row)
    shutil.rmtree(tmp, ignore_errors=True)
    return results


def summary(results: list[dict]) -> str:
    ok = [r for r in results if r["detected"] and r["named"] and r["others_load"]]
    lines = [f"{len(ok)}/{len(results)} damaged files detected and named; undamaged loaded"]
    for f in FILES:
        rows = [r for r in results if r["file"] == f]
        good = sum(r["detected"] and r["named"] for r in rows)
        lines.append(f"  {f:36s} {good}/{len(rows)}")
    for r in results:
        if r not in ok:
            lines.append(f"  FAILED trial {r['trial']}: {r['file']} {r['damage']}: {r['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    results = run(args.trials, args.seed)
    print(summary(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if all(r["detected"] and r["named"] and r["others_load"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

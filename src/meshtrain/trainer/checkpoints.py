"""``output_dir/checkpoint-<step>``: what the Trainer saves, which ones it keeps, where it
resumes.

Each checkpoint is a meshtrain sharded checkpoint written by ``engine.save_checkpoint``
(every rank writes its own shard; committed atomically; loadable under another world
size or ZeRO stage), with the ``TrainerState`` inside its manifest. Beside the shards,
rank 0 writes ``trainer_state.json`` and, for a transformers model, a ``save_pretrained``
export (``config.json`` + ``model.safetensors``, plus the tokenizer when the Trainer has
one), so ``AutoModel.from_pretrained("out/checkpoint-500")`` works as with transformers.

Retention (``save_total_limit``): transformers 5's rule -- the newest checkpoint (to
resume from) and the best one are never deleted; the oldest others go until
``max(limit, protected)`` remain; with a limit of 1 the end of training keeps only the
best (``load_best_model_at_end``'s).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from meshtrain.errors import CheckpointError
from meshtrain.interop.trainer_source import is_trainer_checkpoint

PREFIX = "checkpoint-"


def _step_re(prefix: str) -> re.Pattern:
    return re.compile(rf"^{re.escape(prefix)}(\d+)$")


def checkpoint_steps(output_dir: str | Path, prefix: str = PREFIX) -> list[int]:
    """Steps of the complete checkpoints in ``output_dir``, ascending."""
    from meshtrain.checkpoint.manifest import MANIFEST

    root = Path(output_dir)
    if not root.is_dir():
        return []
    steps = []
    pattern = _step_re(prefix)
    for d in root.iterdir():
        m = pattern.match(d.name)
        if m and (d / MANIFEST).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def last_checkpoint(output_dir: str | Path, prefix: str = PREFIX) -> Path | None:
    """The newest complete checkpoint (transformers' ``get_last_checkpoint``), meshtrain's
    or one the transformers Trainer wrote (``interop.trainer_source``): a run switching to
    meshtrain resumes where transformers stopped."""
    steps = set(checkpoint_steps(output_dir, prefix))
    root, pattern = Path(output_dir), _step_re(prefix)
    if root.is_dir():
        for d in root.iterdir():
            m = pattern.match(d.name)
            if m and is_trainer_checkpoint(d):
                steps.add(int(m.group(1)))
    return root / f"{prefix}{max(steps)}" if steps else None


def resolve_resume(
    resume: bool | str | Path | None, output_dir: str | Path, prefix: str = PREFIX
) -> Path | None:
    """The checkpoint directory ``resume_from_checkpoint`` names (True: the newest)."""
    if resume is None or resume is False:
        return None
    if resume is True:
        path = last_checkpoint(output_dir, prefix)
        if path is None:
            raise CheckpointError(
                f"resume_from_checkpoint=True but {output_dir} holds no complete "
                f"{prefix}<step> directory; train without it or pass a checkpoint path"
            )
        return path
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(
            f"resume_from_checkpoint: {path} is not a directory; pass a {prefix}<step> folder "
            f"(complete ones in {output_dir}: {checkpoint_steps(output_dir, prefix)})"
        )
    return path


def is_better(value: float, best: float | None, greater_is_better: bool) -> bool:
    """Whether ``value`` beats ``best`` (ties do not: the earlier checkpoint stays best)."""
    if best is None:
        return True
    return value > best if greater_is_better else value < best


def to_delete(steps: list[int], limit: int | None, best: int | None) -> list[int]:
    """Steps whose checkpoints rotation removes: transformers' ``rotate_checkpoints`` --
    the newest (to resume from) and the best are protected, and the oldest others go
    until ``max(limit, protected)`` remain."""
    if not limit or limit <= 0 or len(steps) <= limit:
        return []
    ordered = sorted(steps)
    protected = {ordered[-1]} | ({best} if best is not None and best in ordered else set())
    keep = max(limit, len(protected))
    remaining, doomed = len(ordered), []
    for step in ordered:
        if remaining <= keep:
            break
        if step not in protected:
            doomed.append(step)
            remaining -= 1
    return doomed


def sort_checkpoints(
    output_dir: str | Path, checkpoint_prefix: str = "checkpoint", best_model_checkpoint=None
) -> list[str]:
    """transformers' ``sort_checkpoints``: ``<prefix>-<step>`` folders, oldest first, with
    the best moved just before the newest (protected from deletion)."""
    root = Path(output_dir)
    found = []
    for d in root.glob(f"{checkpoint_prefix}-*"):
        m = re.match(rf".*{re.escape(checkpoint_prefix)}-([0-9]+)$", str(d))
        if d.is_dir() and m:
            found.append((int(m.group(1)), str(d)))
    ordered = [path for _, path in sorted(found)]
    if best_model_checkpoint is not None:
        best = str(Path(best_model_checkpoint))
        if best in ordered and ordered[-1] != best:
            newest = ordered[-1]
            ordered = [c for c in ordered if c not in (best, newest)] + [best, newest]
    return ordered


def rotate_checkpoints(
    output_dir: str | Path,
    save_total_limit: int | None = None,
    best_model_checkpoint: str | None = None,
    checkpoint_prefix: str = "checkpoint",
) -> None:
    """transformers' ``rotate_checkpoints`` on ``<prefix>-<step>`` folders (``to_delete``)."""
    prefix = f"{checkpoint_prefix}-"
    ordered = sort_checkpoints(output_dir, checkpoint_prefix)
    steps = [step_of(c, prefix) for c in ordered]
    delete(
        output_dir,
        to_delete(steps, save_total_limit, step_of(best_model_checkpoint, prefix)),
        prefix,
    )


def get_last_checkpoint(folder: str | Path) -> str | None:
    """transformers' ``get_last_checkpoint``: the ``checkpoint-<step>`` folder with the
    highest step (complete or not), or None."""
    ordered = sort_checkpoints(folder)
    return ordered[-1] if ordered else None


def delete(output_dir: str | Path, steps: list[int], prefix: str = PREFIX) -> None:
    """Remove checkpoints; renamed first so a crash never leaves a half-deleted complete one."""
    root = Path(output_dir)
    for step in steps:
        src = root / f"{prefix}{step}"
        doomed = root / f".del-{prefix}{step}"
        try:
            src.rename(doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)


def step_of(path: str | Path | None, prefix: str = PREFIX) -> int | None:
    """The step in a ``checkpoint-<step>`` path, or None."""
    if path is None:
        return None
    m = _step_re(prefix).match(Path(path).name)
    return int(m.group(1)) if m else None


__all__ = [
    "PREFIX",
    "checkpoint_steps",
    "delete",
    "get_last_checkpoint",
    "rotate_checkpoints",
    "sort_checkpoints",
    "is_better",
    "last_checkpoint",
    "resolve_resume",
    "step_of",
    "to_delete",
]

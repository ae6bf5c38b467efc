"""``output_dir/checkpoint-<step>``: what the Trainer saves, which ones it keeps, where it
resumes.

Each checkpoint is a meshtrain sharded checkpoint written by ``engine.save_checkpoint``
(every rank writes its own shard; committed atomically; loadable under another world
size or ZeRO stage), with the ``TrainerState`` inside its manifest. Beside the shards,
rank 0 writes ``trainer_state.json`` and, for a transformers model, a ``save_pretrained``
export (``config.json`` + ``model.safetensors``, plus the tokenizer when the Trainer has
one), so ``AutoModel.from_pretrained("out/checkpoint-500")`` works as with transformers.

Retention (``save_total_limit``): transformers' rule -- the best checkpoint counts as the
newest, so the newest ``limit - 1`` and the best survive, and with a limit of 1 and a best
that is not the newest both are kept (resuming needs the newest) -- with the guarantee
its issues #15089/#39560 ask for: the best checkpoint is never deleted.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from meshtrain.errors import CheckpointError

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
    """The newest complete checkpoint (transformers' ``get_last_checkpoint``)."""
    steps = checkpoint_steps(output_dir, prefix)
    return Path(output_dir) / f"{prefix}{steps[-1]}" if steps else None


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
    """Steps whose checkpoints rotation removes (see the module docstring)."""
    if not limit or len(steps) <= limit:
        return []
    ordered = sorted(steps)
    if best is not None and best in ordered:
        ordered.remove(best)
        ordered.append(best)  # the best counts as the newest
    if limit == 1 and best is not None and best in steps and best != max(steps):
        limit = 2  # keep the newest too, or there is nothing to resume from
    doomed = ordered[: max(0, len(ordered) - limit)]
    return sorted(s for s in doomed if s != best)


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
    "is_better",
    "last_checkpoint",
    "resolve_resume",
    "step_of",
    "to_delete",
]

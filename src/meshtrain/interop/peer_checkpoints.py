"""Which framework wrote a checkpoint folder, and the source that reads it.

``engine.load_checkpoint(dir)`` asks here first: a folder another framework wrote is read
by that framework's source (``deepspeed_source``, ``dcp_source``, ``trainer_source`` for a
transformers Trainer ``checkpoint-N/``, named as ``dir`` or as ``dir`` + ``tag``); meshtrain's own folders
(a manifest, or a ``latest`` naming a tag with one) and empty or absent ones go on to
meshtrain's reader (which returns ``(None, None)`` for nothing to load, as DeepSpeed
does). A folder that holds another kind of checkpoint this reader does not read is refused
in one line naming the kind and what to do, never taken for "nothing to load" (which
would silently start the run from scratch). An accelerate ``save_state`` folder is read by
``Accelerator.load_state`` (``accelerate_source``: its optimizer file is keyed by the
prepared optimizer's parameter order, which only the Accelerator knows), so here it is
pointed there.
"""

from __future__ import annotations

from pathlib import Path

from meshtrain.checkpoint.manifest import LATEST, MANIFEST
from meshtrain.errors import CheckpointError
from meshtrain.interop.dcp_source import DcpSource, dcp_folder
from meshtrain.interop.deepspeed_source import DeepSpeedSource, deepspeed_tag
from meshtrain.interop.trainer_source import TrainerSource, is_trainer_checkpoint

# File names and suffixes that mark a checkpoint of some framework.
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".distcp", ".ckpt")


def open_peer_checkpoint(load_dir, tag: str | None):
    """The opened source of a peer's checkpoint in ``load_dir`` (``tag``: the peer's tag,
    default its ``latest``), or None when it is meshtrain's (or holds nothing)."""
    path = Path(load_dir)
    if not path.is_dir():
        return None
    folder = deepspeed_tag(path, tag)
    if folder is not None:
        return DeepSpeedSource(folder)
    folder = dcp_folder(path, tag)
    if folder is not None:
        return DcpSource(folder)
    folder = path if tag is None else path / str(tag)
    if folder.is_dir() and is_trainer_checkpoint(folder):
        return TrainerSource(folder)
    if tag is None and not (path / MANIFEST).is_file() and not (path / LATEST).is_file():
        refuse_foreign(path)
    return None


def refuse_foreign(path: Path) -> None:
    """Raise for a folder holding another kind of checkpoint (or one of an unknown kind)."""
    if any(p.name == MANIFEST for p in path.glob(f"*/{MANIFEST}")):
        return  # meshtrain tags without a 'latest': the reader's error names them
    files = sorted(p for p in path.iterdir() if not p.name.startswith("."))
    names = {p.name for p in files}
    inner = [p for p in files if p.is_dir() and not p.name.startswith(".")]
    trainer = sorted((p.name for p in inner if is_trainer_checkpoint(p)), key=lambda n: (len(n), n))
    kind = None
    if trainer:  # an output_dir: which checkpoint to resume is the caller's choice
        kind = (
            f"transformers Trainer checkpoints ({', '.join(trainer[:3])}), no 'latest' naming "
            f"one; pass one of them: load_checkpoint({str(path)!r}, tag={trainer[-1]!r})"
        )
    elif any(n.endswith(".distcp") for n in names):
        kind = (
            "a torch.distributed.checkpoint (DCP) folder without its .metadata (the save "
            "did not finish, or the file was not copied); copy the whole folder again"
        )
    elif "config.json" in names and any(n.endswith((".safetensors", ".bin")) for n in names):
        kind = (
            "a transformers model folder (weights, no optimizer state); load it with "
            "meshtrain.from_pretrained(folder, config=...)"
        )
    elif any(n.startswith("random_states_") for n in names) or "optimizer.bin" in names:
        kind = (
            "an accelerate save_state folder, which meshtrain's Accelerator reads: resume "
            "it with accelerator.load_state(folder) after prepare (the same objects in the "
            "same order), not with engine.load_checkpoint"
        )
    elif any(p.is_file() and p.name.endswith(WEIGHT_SUFFIXES) for p in files):
        shown = ", ".join(sorted(n for n in names if n.endswith(WEIGHT_SUFFIXES))[:3])
        kind = (
            f"a checkpoint of a kind meshtrain does not know ({shown}: no manifest.json, no "
            "DeepSpeed 'latest' or model-states file); point load_checkpoint at a meshtrain "
            "save_dir or a DeepSpeed checkpoint folder"
        )
    if kind is not None:
        raise CheckpointError(f"load_checkpoint: {path} holds {kind}")

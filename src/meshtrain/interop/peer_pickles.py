"""Peer checkpoints that are pickles, read without running code from them.

DeepSpeed's and the transformers Trainer's ``.pt`` files are torch zip archives whose
``data.pkl`` names a few of the peer's own classes beside tensors (DeepSpeed 0.19.8:
``LossScaler`` / ``DynamicLossScaler``, ``ZeroStageEnum``, ``fragment_address``). A plain
``torch.load`` would import DeepSpeed and run its constructors, or any code a damaged or
hostile file names. Here every file goes through ``torch.load(weights_only=True)``, torch's
restricted unpickler, with only those names mapped to inert records defined below (data
holders: nothing of the peer is imported, so the peer need not be installed). Any other
name is refused with the file, the name and the fix. The transformers Trainer's
``rng_state*.pth`` hold numpy's Mersenne-Twister state as an ``ndarray``: for those files
(``arrays=True``) numpy's three array-rebuilding names are accepted too (the ones
transformers itself allows for that file), and nothing else of numpy.

Files are memory-mapped (``mmap=True``): a rank that reads a slice of a partition touches
only that slice's pages, which is what keeps reading a peer checkpoint bounded like sliced
loading (each rank its slice, plus the one tensor being cut).
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from meshtrain.errors import CheckpointError


class LossScalerRecord:
    """DeepSpeed's ``LossScaler`` / ``DynamicLossScaler`` as data: the attributes its
    pickle carries (``cur_scale``, ``cur_iter``, ``cur_hysteresis``, ...) and nothing else."""

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class ZeroStageRecord(int):
    """DeepSpeed's ``ZeroStageEnum`` member, as its stage number."""


class FragmentRecord:
    """DeepSpeed's ``fragment_address`` dataclass (``numel``, ``start``), as data."""


# The peer's names this reader maps, each to its record (the only names it accepts beyond
# torch's own tensor-rebuilding ones).
PEER_RECORDS: tuple[tuple[Any, str], ...] = (
    (LossScalerRecord, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (LossScalerRecord, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (ZeroStageRecord, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentRecord, "deepspeed.utils.tensor_fragment.fragment_address"),
)


# What to do with a DeepSpeed file that needs code: DeepSpeed's own converter, where trusted.
DEEPSPEED_FIX = "for DeepSpeed: zero_to_fp32.py, then meshtrain.from_pretrained"


def numpy_arrays() -> list[Any]:
    """numpy's names that rebuild a plain ``ndarray`` (the array, its dtype, its dtype's
    class): data, no code of the file's choosing."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_peer_file(
    path: str | Path,
    what: str,
    *,
    allowed: tuple = (),
    fix: str = DEEPSPEED_FIX,
    arrays: bool = False,
) -> Any:
    """``path`` (a torch ``.pt`` of the peer ``what``) through the restricted unpickler,
    memory-mapped. ``allowed``: further names the file may hold (objects, or ``(object,
    "module.name")`` pairs as torch's ``safe_globals`` takes them), on top of the peer
    records; ``arrays``: numpy arrays too (:func:`numpy_arrays`); ``fix``: what the user
    can do with a file that needs more. A missing, truncated or damaged file and a pickle
    that needs code are each refused in one line naming the file and the fix."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing; copy the whole {what} checkpoint folder again from where it "
            "was written"
        )
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"{path}: not a torch zip archive (truncated, damaged, or saved with "
            f"_use_new_zipfile_serialization=False); copy the {what} checkpoint again "
            "from where it was written"
        )
    try:
        names = [*PEER_RECORDS, *allowed, *(numpy_arrays() if arrays else [])]
        with torch.serialization.safe_globals(names):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError or others
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        text = str(exc)
        needs = ("GLOBAL", "Unsupported global", "unrecognized function", "Can only build")
        if any(n in text for n in needs):
            name = _global_named(str(exc))
            raise CheckpointError(
                f"{path}: the pickle needs {name} to be imported and run, which meshtrain "
                "never does with a checkpoint; re-save it holding only tensors and plain "
                f"values, or convert it where it was written and trusted ({fix})"
            ) from None
        raise CheckpointError(
            f"{path}: cannot be read as a {what} checkpoint file ({first[:160]}); it is "
            "truncated or damaged: copy it again from where it was written"
        ) from None


def release_pages(view: torch.Tensor) -> None:
    """Drop the pages under ``view`` (a tensor of a file ``load_peer_file`` mapped, already
    copied out) from this process's resident memory: a mapped page once touched stays
    resident while the file is mapped, so a rank reading its slice of every optimizer
    state would hold that slice twice until the source closes (measured at ZeRO 3 on 2
    ranks: 2.3x the model per rank at the peak, the floor being 1.0x). ``MADV_DONTNEED``
    on a private file mapping never written to only unmaps: the page cache keeps the
    bytes and a later read faults them in again. Only for tensors of such files (on
    anonymous memory it would zero them), which every tensor ``load_peer_file`` returns
    is; a no-op where the platform has no ``madvise``."""
    import ctypes
    import mmap

    advice = getattr(mmap, "MADV_DONTNEED", None)
    if advice is None or view.numel() == 0:
        return
    start, size = view.data_ptr(), view.numel() * view.element_size()
    lo = start - start % mmap.PAGESIZE
    hi = -(-(start + size) // mmap.PAGESIZE) * mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), ctypes.c_int(advice))


def _global_named(message: str) -> str:
    """The name torch's restricted unpickler refused (``GLOBAL posix.system ...``)."""
    found = (
        re.search(r"GLOBAL ([\w.]+)", message)
        or re.search(r"unrecognized function ([^\s]+)", message)
        or re.search(r"but got <class '([\w.]+)'>", message)
    )
    return found.group(1) if found else "code"

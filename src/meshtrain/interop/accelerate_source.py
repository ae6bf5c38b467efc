"""An accelerate 1.15 ``save_state`` folder, read for ``Accelerator.load_state``.

What accelerate's ``checkpointing.save_accelerator_state`` and ``save_custom_state`` write
(plain DDP or one process; ``i`` is the object's place among the prepared ones of its kind,
the first without a suffix):

==============================================  ===========================================
file                                            what it holds, and how it is read here
==============================================  ===========================================
``model.safetensors`` / ``model_{i}.safetensors``  the unwrapped model's state dict, whole
                                                (``SafetensorsSource``: each rank reads only
                                                its own element ranges)
``pytorch_model.bin`` / ``pytorch_model_{i}.bin``  the same with ``safe_serialization=False``
                                                (torch zip, restricted unpickler)
``optimizer.bin`` / ``optimizer_{i}.bin``       the user's optimizer's ``state_dict()``: per
                                                parameter *index* (over its param groups in
                                                order, as constructed) ``step`` and the
                                                state tensors; the groups' hyper-parameters
``scheduler.bin`` / ``scheduler_{i}.bin``       the LR scheduler's ``state_dict()``
``custom_checkpoint_{i}.pkl``                   ``register_for_checkpointing`` object ``i``'s
                                                ``state_dict()``, ``torch.save``'d
``random_states_{rank}.pkl``                    ``step`` (the accumulation counter), python
                                                ``random``, numpy (an ``ndarray``) and torch
                                                CPU / CUDA generator states of that process
``scaler.pt``                                   fp16 on CUDA: ``GradScaler``'s state
``sampler.bin``, ``dl_state_dict.bin``          accelerate's seedable sampler object and
                                                torchdata's stateful loader: refused by name
==============================================  ===========================================

The index of ``optimizer.bin`` is mapped to a name through the prepared optimizer's own
parameter order (``PreparedOptimizer.param_names``, recorded before the engine re-points
the optimizer at its master chunks), which is the order accelerate saved in: the user's
optimizer as constructed. :class:`AccelerateSource` then serves the engine's loader
(``engine.checkpoint_load``) like any peer source: every rank reads the element ranges of
its own layout (any dp size, ZeRO stage), weights from the model file, optimizer states
from the index's tensors; the step, the groups' hyper-parameters (``lr`` included, as
torch's ``Optimizer.load_state_dict`` restores them) carry over.

Every file that is a pickle goes through ``torch.load(weights_only=True)``
(``peer_pickles``); the RNG file may name only numpy's array and dtype rebuilders beside
that (``peer_pickles.numpy_arrays``). Nothing of accelerate is imported, so it need not be installed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshtrain.errors import CheckpointError
from meshtrain.interop.peer_pickles import load_peer_file, release_pages
from meshtrain.interop.safetensors_source import SafetensorsSource
from meshtrain.interop.tied_names import stored_name

WHAT = "accelerate"
FIX = "for a registered object: make its state_dict() return tensors and plain values"
# The optimizer hyper-parameters carried into the engine's param groups (torch's names);
# the kernel switches (foreach, fused, capturable) stay the resuming run's own.
HYPER = frozenset({
    "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "momentum", "dampening",
    "nesterov", "initial_lr",
})  # fmt: skip
# What accelerate writes for loaders meshtrain's prepared loaders do not have.
LOADER_FILES = ("sampler", "dl_state_dict")


def suffixed(stem: str, index: int, ext: str) -> str:
    """accelerate's name of object ``index``'s file: ``stem.ext``, then ``stem_{i}.ext``."""
    return f"{stem}.{ext}" if index == 0 else f"{stem}_{index}.{ext}"


def is_accelerate_folder(path: Path) -> bool:
    """Whether ``path`` is a folder accelerate's ``save_state`` wrote (every process writes
    its ``random_states_{rank}.pkl``; ``optimizer.bin`` marks one too)."""
    return path.is_dir() and (
        any(path.glob("random_states_*.pkl")) or (path / "optimizer.bin").is_file()
    )


def refuse_plugin_layouts(path: Path) -> None:
    """accelerate's DeepSpeed and FSDP plugins save their own sharded folders inside;
    those are not read yet: say so by name."""
    inner = sorted(p.name for p in path.iterdir() if p.is_dir())
    plugin = [n for n in inner if n.startswith(("pytorch_model", "optimizer_"))]
    if plugin:
        raise CheckpointError(
            f"{path}: an accelerate save_state folder written under its DeepSpeed or FSDP "
            f"plugin ({plugin[0]}/) is not read by Accelerator.load_state yet; resume it "
            "with accelerate, or consolidate the weights there and load them with "
            "meshtrain.from_pretrained"
        )
    for stem in LOADER_FILES:
        found = sorted(path.glob(f"{stem}*.bin"))
        if found:
            raise CheckpointError(
                f"{found[0]}: accelerate's state of a seedable sampler or a torchdata "
                "StatefulDataLoader, which meshtrain's prepared loaders do not use; delete "
                "the file and resume the data position with skip_first_batches"
            )


def load_weights(path: Path, index: int) -> dict[str, torch.Tensor] | None:
    """Model ``index``'s whole state dict (for a model without an engine), or None when
    the folder has no weights for it."""
    from safetensors.torch import load_file

    safe = path / suffixed("model", index, "safetensors")
    if safe.is_file():
        return load_file(str(safe))
    pickled = path / suffixed("pytorch_model", index, "bin")
    if pickled.is_file():
        return dict(load_peer_file(pickled, WHAT, fix=FIX))
    return None


def load_small(path: Path) -> Any:
    """A scheduler, optimizer, scaler or registered object's state (a torch zip pickle)."""
    return load_peer_file(path, WHAT, fix=FIX)


def read_rng(path: Path) -> dict[str, Any]:
    """``random_states_{rank}.pkl``, through the restricted unpickler with numpy's array
    names only; its entries checked before anything is set."""
    states = load_peer_file(
        path,
        WHAT,
        arrays=True,  # numpy's state is a tuple with a uint32 ndarray, nothing else of numpy
        fix="accelerate writes only generator states there, so this file was changed after "
        "the save: copy the folder again",
    )
    wanted = {"random_state": tuple, "numpy_random_seed": tuple, "torch_manual_seed": torch.Tensor}
    bad = [k for k, t in wanted.items() if not isinstance(states.get(k), t)]
    if not isinstance(states, Mapping) or bad:
        raise CheckpointError(
            f"{path}: not accelerate's RNG states (no {bad[0] if bad else 'dict'} entry); "
            "copy the save_state folder again from where it was written"
        )
    return dict(states)


def set_rng(states: Mapping[str, Any]) -> None:
    """Restore what :func:`read_rng` returned, as accelerate's ``load_accelerator_state``."""
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    cuda = states.get("torch_cuda_manual_seed")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


class AccelerateSource:
    """Model ``model_index`` and optimizer ``optimizer_index`` of an accelerate folder,
    read by element ranges in the model's names (the engine loader's interface)."""

    def __init__(
        self,
        folder: str | Path,
        model_index: int,
        optimizer_index: int,
        param_names: list[list[str]],
    ) -> None:
        self.path = Path(folder)
        safe = self.path / suffixed("model", model_index, "safetensors")
        pickled = self.path / suffixed("pytorch_model", model_index, "bin")
        self.weights: SafetensorsSource | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        if safe.is_file():
            self.weights = SafetensorsSource(safe)
        elif pickled.is_file():
            self.tensors = dict(load_peer_file(pickled, WHAT, fix=FIX))
        else:
            raise CheckpointError(
                f"{self.path}: no {safe.name} or {pickled.name} for prepared model "
                f"{model_index}; copy the whole save_state folder, and prepare the same "
                "models in the same order as the run that saved it"
            )
        opt_file = self.path / suffixed("optimizer", optimizer_index, "bin")
        if not opt_file.is_file():
            raise CheckpointError(
                f"{opt_file}: missing, and the optimizer is prepared (accelerate's save_state "
                "writes it beside the weights); copy the whole save_state folder again, or "
                "load only the weights with model.load_state_dict before prepare"
            )
        self.optim = load_peer_file(opt_file, WHAT, fix=FIX)
        if not isinstance(self.optim, Mapping) or not {"state", "param_groups"} <= set(self.optim):
            raise CheckpointError(
                f"{opt_file}: not an optimizer state_dict (no 'state' / 'param_groups'); "
                "copy the save_state folder again"
            )
        self.opt_file = opt_file
        self.index = self._indices(param_names)
        self.aliases: dict[str, str] = {}

    def _indices(self, param_names: list[list[str]]) -> dict[str, int]:
        """name -> the index accelerate saved its state under (optimizer order)."""
        saved = [len(g.get("params", [])) for g in self.optim["param_groups"]]
        mine = [len(g) for g in param_names]
        if saved != mine:
            raise CheckpointError(
                f"{self.opt_file}: saved by an optimizer with param groups of {saved} "
                f"parameters, the prepared one has {mine}; build the optimizer as the run "
                "that saved it did (the same groups, in the same order)"
            )
        out: dict[str, int] = {}
        for g, names in zip(self.optim["param_groups"], param_names, strict=True):
            for i, name in zip(g["params"], names, strict=True):
                out.setdefault(name, int(i))
        return out

    # --- names ----------------------------------------------------------------------

    def use_aliases(self, aliases: Mapping[str, str]) -> None:
        self.aliases = dict(aliases)  # resolved here (_name): the files hold one of each

    def _keys(self) -> set[str]:
        return set(self.weights.keys()) if self.weights is not None else set(self.tensors)

    def _name(self, name: str) -> str | None:
        return stored_name(name, self.aliases, self._keys())

    def _opt_index(self, name: str) -> int | None:
        key = stored_name(name, self.aliases, self.index)
        return None if key is None else self.index[key]

    # --- the reader interface the engine's loader uses ------------------------------

    def shape(self, name: str) -> tuple[int, ...]:
        key = self._name(name)
        if key is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in the model file")
        if self.weights is not None:
            return self.weights.shape(key)
        return tuple(self.tensors[key].shape)

    def check_model(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        wrong = []
        for name, shape in expected.items():
            if self._name(name) is None:
                wrong.append(f"{name} (missing)")
            elif self.shape(name) != tuple(shape):
                wrong.append(f"{name} {self.shape(name)} != {tuple(shape)}")
        for name, i in self.index.items():
            for key, t in (self.optim["state"].get(i) or {}).items():
                if isinstance(t, torch.Tensor) and t.dim() > 0 and name in expected:
                    if tuple(t.shape) != tuple(expected[name]):
                        wrong.append(f"{self.opt_file.name}[{i}].{key} {tuple(t.shape)}")
        if wrong:
            raise CheckpointError(
                f"{self.path}: this accelerate save_state folder is of another model "
                f"({len(wrong)} tensors differ: {', '.join(wrong[:3])}); load it into the "
                "model (and optimizer) that saved it"
            )

    def states(self) -> list[str]:
        first = next(iter(self.optim["state"].values()), {})
        names = [k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return ["param", *names]

    def read(self, name: str, state: str = "param", start: int = 0, numel: int | None = None):
        if state == "param":
            key = self._name(name)
            if key is None:
                raise CheckpointError(f"{self.path}: no tensor {name!r} in the model file")
            if self.weights is not None:
                return self.weights.read(key, "param", start, numel)
            flat = self.tensors[key].reshape(-1)
            numel = flat.numel() - start if numel is None else numel
            return flat[start : start + numel].clone()
        numel = math.prod(self.shape(name)) - start if numel is None else numel
        i = self._opt_index(name)
        t = None if i is None else (self.optim["state"].get(i) or {}).get(state)
        if t is None:  # a parameter the saved optimizer never stepped: a fresh state
            return torch.zeros(numel, dtype=torch.float32)
        view = t.reshape(-1)[start : start + numel]
        out = view.float().clone()
        release_pages(view)  # the copy is out: its mapped pages leave this rank
        return out

    def read_into(self, name: str, start: int, out: torch.Tensor) -> bool:
        key = self._name(name)
        if self.weights is None or key is None:
            return False
        return self.weights.read_into(key, start, out)

    def read_full(self, name: str, state: str = "param") -> torch.Tensor:
        return self.read(name, state).reshape(self.shape(name))

    @property
    def step(self) -> float | None:
        first = next(iter(self.optim["state"].values()), {})
        step = first.get("step")
        return None if step is None else float(step)

    @property
    def world_size(self) -> int | None:
        return None  # the RNG states are restored by the Accelerator (random_states_*.pkl)

    @property
    def meta(self) -> dict[str, Any]:
        steps = int(self.step or 0)  # the optimizer steps taken: AdamW's own count
        return {
            "global_steps": steps,
            "micro_steps": None,
            "skipped_steps": 0,
            "data_loader": None,
            "client_state": {},
        }

    def rank_state(self, rank: int) -> dict[str, Any]:
        step = self.step
        return {
            "optimizer_step": [] if step is None else [step],
            "param_groups": [
                {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k in HYPER}
                for g in self.optim["param_groups"]
            ],
            "scaler": None,
            "scheduler": None,
        }

    def close(self) -> None:
        if self.weights is not None:
            self.weights.close()
        self.tensors, self.optim = {}, {}

    def __enter__(self) -> AccelerateSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = [
    "AccelerateSource",
    "is_accelerate_folder",
    "load_small",
    "load_weights",
    "read_rng",
    "refuse_plugin_layouts",
    "set_rng",
    "suffixed",
]

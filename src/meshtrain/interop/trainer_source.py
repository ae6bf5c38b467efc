"""A transformers Trainer ``checkpoint-N/`` folder as a source the engine's loader reads
element ranges from (``Trainer.train(resume_from_checkpoint=...)`` on what transformers
5.x wrote, or ``engine.load_checkpoint`` on it).

What the folder holds, as transformers' ``Trainer._save_checkpoint`` writes it, and how
each piece is read:

* the weights: ``model.safetensors`` (or ``model-0000K-of-0000N.safetensors`` with
  ``model.safetensors.index.json``), read by range through ``SafetensorsSource`` (each
  rank reads only its slices' bytes); with ``save_safetensors=False``,
  ``pytorch_model.bin`` (or its shards and ``pytorch_model.bin.index.json``) through
  ``torch.load(weights_only=True, mmap=True)``. In the no-ZeRO Trainer these are the fp32
  weights the optimizer steps (a bf16/fp16 run keeps fp32 weights under autocast), so they
  are the masters.
* ``optimizer.pt``: ``torch.optim`` state dict, its ``state`` keyed by the integer index
  of each parameter in its ``param_groups`` order. transformers' ``create_optimizer``
  builds that order as the decay parameters then the no-decay ones, each in
  ``model.named_parameters()`` order and trainable only, the decay set being
  ``Trainer.get_decay_parameter_names(model)``; :meth:`use_model` rebuilds the same order
  from the resuming model (asking transformers' own rule, so a later change of its
  patterns is followed) and maps each index to its parameter's name. Group sizes that do
  not match are refused by name: the optimizer was built another way (a custom
  ``create_optimizer``, another model). Carried over: AdamW's ``exp_avg`` /
  ``exp_avg_sq`` (any element-wise state), ``step``, and each group's hyper-parameters
  (the current ``lr`` among them); the kernel switches stay the resuming run's.
* ``scheduler.pt``: a torch ``LambdaLR`` state dict (``last_epoch``, ``base_lrs``,
  ``_last_lr``), loaded as it is into the resuming Trainer's ``LambdaLR``.
* ``rng_state.pth`` / ``rng_state_{rank}.pth``: python, numpy, torch CPU (and CUDA)
  generator states, read with numpy arrays allowed and nothing else
  (``peer_pickles.numpy_arrays``); restored by :meth:`restore_rng` when the run has as
  many processes as the one that wrote them (a rank's stream means nothing under
  another layout), at the point the Trainer's loop chooses (transformers' point).
* ``trainer_state.json``: ``global_step``, ``epoch``, ``log_history``, the best metric
  and checkpoint, ``stateful_callbacks``: the resumed ``TrainerState``.
* ``training_args.bin``: a pickle of transformers' ``TrainingArguments`` object, which only
  arbitrary unpickling can rebuild: never read. The resuming run's own arguments apply
  (:data:`ARGS_NOTE`).

Not read, so refused where they would be needed: DeepSpeed or FSDP state inside the
folder (``global_step*/``, ``pytorch_model_fsdp*``), and a ``scaler.pt``-style loss
scale (transformers 5 keeps none for fp32 and bf16 runs).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from meshtrain.checkpoint.manifest import MANIFEST
from meshtrain.errors import CheckpointError
from meshtrain.files.structured import load_json
from meshtrain.interop.deepspeed_source import HYPER
from meshtrain.interop.peer_pickles import load_peer_file
from meshtrain.interop.safetensors_source import INDEX, SINGLE, SafetensorsSource
from meshtrain.interop.tied_names import stored_name

TRAINER_STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
ARGS = "training_args.bin"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
WHAT = "transformers Trainer"
ARGS_NOTE = (
    "{path}: training_args.bin (a pickle of transformers' TrainingArguments) was not read "
    "(it needs arbitrary unpickling); this run's own TrainingArguments apply"
)


def is_trainer_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` is a ``checkpoint-N/`` the transformers Trainer wrote (its state
    file, and no meshtrain manifest: meshtrain's own checkpoints carry one beside it)."""
    return (folder / TRAINER_STATE).is_file() and not (folder / MANIFEST).is_file()


class TrainerSource:
    """One transformers Trainer ``checkpoint-N/`` folder (see the module docstring)."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder)
        fix = "copy the checkpoint folder again, or resume from another checkpoint-N"
        state = load_json(self.path / TRAINER_STATE, CheckpointError, what="trainer state",
                          fix=fix, empty_fix=fix)  # fmt: skip
        if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
            raise CheckpointError(
                f"{self.path / TRAINER_STATE}: no integer 'global_step' in it, so it is not a "
                f"transformers TrainerState; {fix}"
            )
        self.trainer_state: dict[str, Any] = state
        self._refuse_kinds()
        self.weights: SafetensorsSource | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        if (self.path / INDEX).is_file() or (self.path / SINGLE).is_file():
            self.weights = SafetensorsSource(self.path)
        elif (self.path / BIN_INDEX).is_file() or (self.path / BIN).is_file():
            self.tensors = self._bin_weights()
        else:
            raise CheckpointError(
                f"{self.path}: no {SINGLE}, {INDEX}, {BIN} or {BIN_INDEX} (the model's weights "
                f"of this {WHAT} checkpoint are missing); {fix}"
            )
        self.optimizer = load_peer_file(self.path / OPTIMIZER, WHAT)
        if not isinstance(self.optimizer, Mapping) or "param_groups" not in self.optimizer:
            raise CheckpointError(
                f"{self.path / OPTIMIZER}: no 'param_groups' in it, so it is not a torch "
                f"optimizer state dict; {fix}"
            )
        self.scheduler = load_peer_file(self.path / SCHEDULER, WHAT)
        # the weights' names, once: every range read looks its tensor up here
        self.names = set(self.tensors) if self.weights is None else set(self.weights.keys())
        self.aliases: dict[str, str] = {}
        self.index: dict[str, int] = {}  # parameter name -> its key in optimizer.pt's state

    # --- files ----------------------------------------------------------------------

    def _refuse_kinds(self) -> None:
        inner = sorted(p.name for p in self.path.iterdir())
        other = [n for n in inner if n.startswith(("global_step", "pytorch_model_fsdp"))]
        if other:
            raise CheckpointError(
                f"{self.path}: a {WHAT} checkpoint saved through DeepSpeed or FSDP ({other[0]}) "
                "is not read yet; resume it with transformers, or load its weights with "
                "meshtrain.from_pretrained(folder) and start the optimizer fresh"
            )

    def _bin_weights(self) -> dict[str, torch.Tensor]:
        files = [self.path / BIN]
        if (self.path / BIN_INDEX).is_file():
            fix = "save the model again with save_pretrained"
            index = load_json(self.path / BIN_INDEX, CheckpointError, what="weight index",
                              fix=fix)  # fmt: skip
            names = (index or {}).get("weight_map") if isinstance(index, dict) else None
            if not isinstance(names, dict):
                raise CheckpointError(f"{self.path / BIN_INDEX}: no 'weight_map' object; {fix}")
            files = [self.path / f for f in dict.fromkeys(names.values())]
        out: dict[str, torch.Tensor] = {}
        for f in files:
            part = load_peer_file(f, WHAT)
            if not isinstance(part, Mapping):
                raise CheckpointError(f"{f}: not a state dict of tensors; save the model again")
            out.update(part)
        return out

    # --- the optimizer's integer keys as names ----------------------------------------

    def use_model(self, model: torch.nn.Module | None) -> None:
        """Map ``optimizer.pt``'s integer keys to ``model``'s parameter names, in the order
        transformers' ``create_optimizer`` gave them (module docstring); None: the run's
        model is split into pipeline stages, whose names are not the whole model's."""
        if model is None:
            raise CheckpointError(
                f"{self.path / OPTIMIZER}: a {WHAT} optimizer state is not read under "
                "pipeline parallelism yet; resume at pipeline_parallel_size 1, or load only "
                "the weights (meshtrain.from_pretrained(folder)) and start the optimizer fresh"
            )
        from transformers import Trainer

        # transformers' own rule (self is unused by it): the writer's decay set exactly
        decay = set(Trainer.get_decay_parameter_names(None, model))
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            [n for n, _ in trainable if n in decay],
            [n for n, _ in trainable if n not in decay],
        ]
        saved = [len(g.get("params", [])) for g in self.optimizer["param_groups"]]
        if saved != [len(g) for g in groups] and saved != [len(g) for g in groups if g]:
            raise CheckpointError(
                f"{self.path / OPTIMIZER}: its param groups hold {saved} parameters, but the "
                f"transformers Trainer's groups of this model (decay, no decay) hold "
                f"{[len(g) for g in groups]}; resume with the model and optimizer set-up that "
                "saved it, or load only the weights (meshtrain.from_pretrained(folder)) and "
                "start the optimizer fresh"
            )
        order = [n for g in groups for n in g]
        keys = [k for g in self.optimizer["param_groups"] for k in g.get("params", [])]
        self.index = dict(zip(order, keys, strict=True))

    def use_aliases(self, aliases: Mapping[str, str]) -> None:
        self.aliases = dict(aliases)
        if self.weights is not None:  # its tied names, as from_pretrained sets them
            self.weights.aliases = dict(aliases)

    def _weight_key(self, name: str) -> str | None:
        return stored_name(name, self.aliases, self.names)

    def _optimizer_key(self, name: str) -> int | None:
        key = stored_name(name, self.aliases, self.index)
        return None if key is None else self.index[key]

    # --- the reader interface the engine's loader uses ------------------------------

    def shape(self, name: str) -> tuple[int, ...]:
        key = self._weight_key(name)
        if key is None:
            raise CheckpointError(f"{self.path}: no weight {name!r}; {self._other_model()}")
        if self.weights is not None:
            return tuple(self.weights.shape(key))
        return tuple(self.tensors[key].shape)

    def _other_model(self) -> str:
        return f"the {WHAT} checkpoint is of another model: resume it with the model that saved it"

    def check_model(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        wrong = []
        for name, shape in expected.items():
            key = self._weight_key(name)
            if key is None:
                wrong.append(f"{name} (missing)")
                continue
            if self.shape(key) != tuple(shape):
                wrong.append(f"{name} {self.shape(key)} != {tuple(shape)}")
            opt = self._optimizer_key(name)
            state = self.optimizer["state"].get(opt, {}) if opt is not None else {}
            for s, t in state.items():
                if isinstance(t, torch.Tensor) and t.dim() > 0 and tuple(t.shape) != tuple(shape):
                    wrong.append(f"{OPTIMIZER} {s} of {name} {tuple(t.shape)} != {tuple(shape)}")
        if wrong:
            raise CheckpointError(
                f"{self.path}: {len(wrong)} tensors differ from the model ({', '.join(wrong[:3])}); "
                f"{self._other_model()}"
            )

    def states(self) -> list[str]:
        first = next(iter(self.optimizer.get("state", {}).values()), {})
        return ["param", *(k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim())]

    def read(self, name: str, state: str = "param", start: int = 0, numel: int | None = None):
        if state == "param":
            key = self._weight_key(name)
            if key is None:
                raise CheckpointError(f"{self.path}: no weight {name!r}; {self._other_model()}")
            if self.weights is not None:
                return self.weights.read(key, "param", start, numel)
            flat = self.tensors[key].reshape(-1)
            numel = flat.numel() - start if numel is None else numel
            return flat[start : start + numel].clone()
        numel = math.prod(self.shape(name)) - start if numel is None else numel
        opt = self._optimizer_key(name)
        entry = self.optimizer["state"].get(opt) if opt is not None else None
        if entry is None:  # never stepped (no gradient yet): torch keeps no state for it
            return torch.zeros(numel)
        return entry[state].reshape(-1)[start : start + numel].clone()

    def read_into(self, name: str, start: int, out: torch.Tensor) -> bool:
        read_into = getattr(self.weights, "read_into", None)
        key = self._weight_key(name)
        return bool(read_into and key is not None and read_into(key, start, out))

    def read_full(self, name: str, state: str = "param") -> torch.Tensor:
        return self.read(name, state).reshape(self.shape(name))

    @property
    def world_size(self) -> int | None:
        return None  # the engine restores no RNG from here: restore_rng, at the loop's point

    @property
    def writer_world_size(self) -> int:
        """How many processes wrote the checkpoint: one ``rng_state_{rank}.pth`` each, or
        ``rng_state.pth`` alone for one process (0: no RNG files)."""
        ranks = list(self.path.glob("rng_state_*.pth"))
        return len(ranks) or int((self.path / "rng_state.pth").is_file())

    @property
    def meta(self) -> dict[str, Any]:
        return {
            "global_steps": int(self.trainer_state["global_step"]),
            "micro_steps": None,  # not kept: the loader counts this run's accumulation
            "skipped_steps": 0,
            "data_loader": None,  # the Trainer places it (transformers' rule, in batches)
            "client_state": {"trainer_state": self.trainer_state},
        }

    def rank_state(self, rank: int) -> dict[str, Any]:
        first = next(iter(self.optimizer.get("state", {}).values()), {})
        step = first.get("step")
        groups = self.optimizer["param_groups"]
        return {
            "optimizer_step": [] if step is None else [float(step)],
            "param_groups": [
                {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k in HYPER}
                for g in groups
                if g.get("params")
            ],
            "scaler": None,
            "scheduler": dict(self.scheduler) if isinstance(self.scheduler, Mapping) else None,
        }

    def restore_rng(self, rank: int, world_size: int) -> str | None:
        """Set python's, numpy's and torch's generators (CUDA's too where there is one) to
        what rank ``rank`` saved; a note saying why not where the layout differs."""
        writers = self.writer_world_size
        if writers != world_size:
            return (
                f"{self.path}: RNG states of {writers} process(es) not restored in a run of "
                f"{world_size}; random streams (dropout, sampling) start from this run's seed"
            )
        name = "rng_state.pth" if world_size == 1 else f"rng_state_{rank}.pth"
        states = load_peer_file(self.path / name, WHAT, arrays=True)
        import numpy as np

        py = states["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        np.random.set_state(states["numpy"])
        torch.set_rng_state(states["cpu"])
        if torch.cuda.is_available() and "cuda" in states:
            cuda = states["cuda"]
            if isinstance(cuda, list | tuple):  # every device's, from a distributed run
                torch.cuda.set_rng_state_all(cuda)
            else:
                torch.cuda.set_rng_state(cuda)
        return None

    def close(self) -> None:
        if self.weights is not None:
            self.weights.close()
        self.tensors, self.optimizer, self.scheduler = {}, {"param_groups": []}, None

    def __enter__(self) -> TrainerSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["ARGS", "ARGS_NOTE", "TrainerSource", "is_trainer_checkpoint"]

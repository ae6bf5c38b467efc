"""A DeepSpeed 0.19.8 checkpoint as a source the engine's loader reads element ranges from.

``engine.load_checkpoint("ckpt")`` on the folder a DeepSpeed script saved to: ``ckpt/latest``
names the tag (``global_stepN``), and the tag folder holds, as DeepSpeed's
``runtime/engine.py`` (``_save_checkpoint``, ``_save_zero_checkpoint``) writes them:

* ``mp_rank_00_model_states.pt`` (ZeRO 0-2) or one ``zero_pp_rank_R_mp_rank_00_model_states.pt``
  per rank (ZeRO 3): ``module`` (the 16-bit or fp32 weights; empty placeholders under
  ZeRO 3), ``param_shapes`` (per param group, in the order of the flat buffers),
  ``buffer_names``, ``lr_scheduler``, ``global_steps``, ``skipped_steps``,
  ``global_samples``, ``dp_world_size``, ``ds_config``, and the script's ``client_state``
  keys beside them; at ZeRO 0 also ``optimizer``, the client optimizer's own state dict.
* ZeRO 1-3: one ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel
  rank R, its partition of the fp32 masters and of each optimizer state:

  - ZeRO 1/2 (``zero/stage_1_and_2.py``): ``single_partition_of_fp32_groups[g]`` and
    ``base_optimizer_state.state[g]``; group ``g``'s flat buffer is its parameters end to
    end in ``param_shapes[g]`` order (each followed by ``param_alignment_paddings[g][i]``
    elements), padded to a multiple of ``2 x dp`` and cut into ``dp`` equal partitions.
  - ZeRO 3 (``zero/stage3.py``): ``fp32_flat_groups[s]`` and ``optimizer_state_dict.state[s]``
    per sub-group, end to end; every parameter is cut on its own into ``dp`` parts of
    ``ceil(numel / dp)`` (the last padded), rank R holding part R of each, parameters in
    ``param_shapes`` order.

The fp32 masters are the source of truth, as in meshtrain's own format: a meshtrain rank
reads exactly the element ranges of its own layout (any dp size, ZeRO stage, tp, pp), from
whichever partitions hold them, and its parameters are then written from the masters. The
optimizer step, param-group hyper-parameters, lr scheduler (DeepSpeed's and meshtrain's
schedules share ``{"last_batch_iteration"}``), step counters and the loss scaler carry
over; ``micro_steps`` is ``global_steps`` times the resuming run's accumulation steps. RNG streams are
not in DeepSpeed's files, so they are left as they are. ``client_state`` is what the
script passed to ``save_checkpoint`` (DeepSpeed's own keys removed).

Refused by name: tensor or pipeline parallel checkpoints (``mp_rank_01``, ``layer_*``),
MoE expert files, and ZeRO-3 sub-groups of one parameter group split by ``sub_group_size``
across a parameter (not written by this reader's proof). Memory: files are memory-mapped
(``peer_pickles``), so a rank touches only the pages of the ranges it reads.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from meshtrain.errors import CheckpointError
from meshtrain.interop.peer_pickles import LossScalerRecord, load_peer_file

# Keys DeepSpeed writes into the model-states file itself; everything else is client_state.
DS_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
    "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info", "data_parallel_sampler",
    "shared_params",
})  # fmt: skip
MODEL_STATES = "mp_rank_00_model_states.pt"
# The optimizer hyper-parameters carried into meshtrain's param groups (torch's names); the
# kernel switches (foreach, fused, capturable) stay the resuming run's own.
HYPER = frozenset({
    "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "momentum", "dampening",
    "nesterov", "initial_lr",
})  # fmt: skip
WHAT = "DeepSpeed"


def is_deepspeed_tag(folder: Path) -> bool:
    """Whether ``folder`` is a tag folder DeepSpeed wrote (its model-states file)."""
    return (folder / MODEL_STATES).is_file() or (
        folder / f"zero_pp_rank_0_{MODEL_STATES}"
    ).is_file()


def deepspeed_tag(load_dir: Path, tag: str | None) -> Path | None:
    """The DeepSpeed tag folder ``load_dir``/``tag`` (or the one ``latest`` names), or None
    when ``load_dir`` holds no DeepSpeed checkpoint."""
    if is_deepspeed_tag(load_dir):
        return load_dir
    if tag is None:
        latest = load_dir / "latest"
        if not latest.is_file():
            return None
        tag = latest.read_text(encoding="utf-8").strip()
    folder = load_dir / str(tag)
    return folder if is_deepspeed_tag(folder) else None


class DeepSpeedSource:
    """One DeepSpeed tag folder, read by element ranges in the unsplit model's names."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder)
        self._refuse_layouts()
        stage3 = (self.path / f"zero_pp_rank_0_{MODEL_STATES}").is_file()
        first = self.path / (f"zero_pp_rank_0_{MODEL_STATES}" if stage3 else MODEL_STATES)
        self.model = load_peer_file(first, WHAT)
        if not isinstance(self.model, Mapping) or "module" not in self.model:
            raise CheckpointError(
                f"{first}: holds no 'module' entry, so it is not a DeepSpeed model-states "
                "file; point load_checkpoint at the folder deepspeed's save_checkpoint wrote"
            )
        cfg = self.model.get("ds_config") or {}
        self.zero_stage = int((cfg.get("zero_optimization") or {}).get("stage", 0))
        if stage3:
            self.zero_stage = 3
        self.dp = int(self.model.get("dp_world_size") or 1)
        self.shapes = self._param_shapes()
        if self.zero_stage == 3 and self.model.get("frozen_param_shapes"):
            raise CheckpointError(
                f"{first}: frozen parameters of a ZeRO-3 DeepSpeed checkpoint "
                f"({next(iter(self.model['frozen_param_shapes']))}, ...) are not read yet; "
                "convert it with DeepSpeed's zero_to_fp32.py and load that with "
                "meshtrain.from_pretrained"
            )
        self.module = {k.removeprefix("module."): v for k, v in self.model["module"].items()}
        self.buffers = set(self.model.get("buffer_names") or [])
        self.aliases: dict[str, str] = {}
        self.optim: list[Mapping[str, Any]] = []
        if self.zero_stage > 0:
            self.optim = [self._optim_file(r) for r in range(self.dp)]
        self._layout = self._place_params()

    # --- files ----------------------------------------------------------------------

    def _refuse_layouts(self) -> None:
        names = sorted(p.name for p in self.path.iterdir())
        other_mp = [n for n in names if re.search(r"mp_rank_(?!00)\d+", n)]
        layers = [n for n in names if n.startswith("layer_") or "expert_" in n]
        if other_mp or layers:
            raise CheckpointError(
                f"{self.path}: a DeepSpeed checkpoint with tensor/pipeline-parallel or expert "
                f"files ({(other_mp + layers)[0]}) is not read yet; convert it with DeepSpeed's "
                "zero_to_fp32.py and load the result with meshtrain.from_pretrained"
            )

    def _optim_file(self, rank: int) -> Mapping[str, Any]:
        for prefix in ("", "bf16_"):
            path = self.path / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            if path.is_file():
                sd = load_peer_file(path, WHAT).get("optimizer_state_dict")
                if not isinstance(sd, Mapping):
                    raise CheckpointError(
                        f"{path}: no optimizer_state_dict in it; the file is not DeepSpeed's "
                        "optimizer partition: copy the checkpoint folder again"
                    )
                return sd
        raise CheckpointError(
            f"{self.path}: zero_pp_rank_{rank}_mp_rank_00_optim_states.pt is missing (the "
            f"checkpoint was written by {self.dp} data-parallel ranks at ZeRO "
            f"{self.zero_stage}); copy every rank's file into the folder"
        )

    def _param_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        shapes = self.model.get("param_shapes")
        if shapes is None:  # ZeRO 0 without them: the module's parameters, in order
            return []
        if isinstance(shapes, Mapping):
            shapes = [shapes]
        return [{k: tuple(int(d) for d in s) for k, s in g.items()} for g in shapes]

    # --- where each parameter's elements sit ---------------------------------------

    def _place_params(self) -> dict[str, tuple]:
        """name -> how to find its elements: ("whole",) at ZeRO 0; ("flat", group,
        offset) at ZeRO 1/2 (offset in the group's flat buffer); ("part", offset, part
        numel) at ZeRO 3 (offset in each rank's concatenated flat vector)."""
        out: dict[str, tuple] = {}
        if self.zero_stage == 0:
            return {n: ("whole",) for n in self.module if n not in self.buffers}
        if self.zero_stage in (1, 2):
            pads = self.optim[0].get("param_alignment_paddings")
            for gi, group in enumerate(self.shapes):
                offset = 0
                for i, (name, shape) in enumerate(group.items()):
                    out[name] = ("flat", gi, offset)
                    offset += math.prod(shape)
                    if pads is not None:
                        offset += int(pads[gi][i])
            return out
        offset = 0
        for group in self.shapes:
            for name, shape in group.items():
                part = math.ceil(math.prod(shape) / self.dp)
                out[name] = ("part", offset, part)
                offset += part
        return out

    def _rank_vectors(self, rank: int, state: str) -> list[torch.Tensor]:
        """Rank ``rank``'s flat tensors of ``state`` ("param" = the fp32 masters), by group."""
        sd = self.optim[rank]
        if self.zero_stage == 3:
            masters, opt = sd["fp32_flat_groups"], sd["optimizer_state_dict"]
        else:
            masters, opt = sd["single_partition_of_fp32_groups"], sd["base_optimizer_state"]
        if state == "param":
            return list(masters)
        per_group = opt["state"]
        return [per_group[i][state] for i in sorted(per_group)]

    def _flat_read(self, vectors_of, start: int, numel: int) -> Iterator[torch.Tensor]:
        """Elements [start, start + numel) of the concatenation of every rank's vectors."""
        pos, end = start, start + numel
        size = sum(v.numel() for v in vectors_of(0))
        while pos < end:
            rank, local = divmod(pos, size)
            take = min(end - pos, size - local)
            yield _slice_concat(vectors_of(rank), local, take)
            pos += take

    # --- the reader interface the engine's loader uses ------------------------------

    def _name(self, name: str) -> str:
        if name in self._layout or name in self.module:
            return name
        for alias, canon in self.aliases.items():  # a tied weight saved under another name
            if canon == name and (alias in self._layout or alias in self.module):
                return alias
            if alias == name and (canon in self._layout or canon in self.module):
                return canon
        raise CheckpointError(
            f"{self.path}: the DeepSpeed checkpoint has no tensor {name!r} (it has "
            f"{sorted(self._layout)[:4]}...); load it into the model that saved it"
        )

    def use_aliases(self, aliases: Mapping[str, str]) -> None:
        self.aliases = dict(aliases)

    def shape(self, name: str) -> tuple[int, ...]:
        name = self._name(name)
        for group in self.shapes:
            if name in group:
                return group[name]
        return tuple(self.module[name].shape)

    def check_model(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        wrong = []
        for name, shape in expected.items():
            try:
                have = self.shape(name)
            except CheckpointError:
                wrong.append(f"{name} (missing)")
                continue
            if tuple(have) != tuple(shape):
                wrong.append(f"{name} {tuple(have)} != {tuple(shape)}")
        if wrong:
            raise CheckpointError(
                f"{self.path}: this DeepSpeed checkpoint is of another model ({len(wrong)} "
                f"tensors differ: {', '.join(wrong[:3])}); load it into the model that saved it"
            )

    def states(self) -> list[str]:
        if self.zero_stage == 0:
            opt = self.model.get("optimizer") or {}
            first = next(iter((opt.get("state") or {}).values()), {})
        else:
            sd = self.optim[0]
            opt = sd["optimizer_state_dict" if self.zero_stage == 3 else "base_optimizer_state"]
            first = next(iter(opt["state"].values()), {})
        names = [k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return ["param", *names]

    def read(self, name: str, state: str = "param", start: int = 0, numel: int | None = None):
        name = self._name(name)
        full = math.prod(self.shape(name))
        numel = full - start if numel is None else numel
        place = self._layout.get(name, ("whole",))
        if place[0] == "whole":
            return self._whole(name, state).reshape(-1)[start : start + numel].float().clone()
        if place[0] == "flat":
            _, gi, offset = place
            out = torch.cat(list(self._flat_read(
                lambda r: [self._rank_vectors(r, state)[gi]], offset + start, numel
            )))  # fmt: skip
            return out.clone()
        _, offset, part = place
        pieces, pos, end = [], start, start + numel
        while pos < end:  # ZeRO 3: element j sits on rank j // part, at j % part of it
            rank, local = divmod(pos, part)
            take = min(end - pos, part - local)
            pieces.append(_slice_concat(self._rank_vectors(rank, state), offset + local, take))
            pos += take
        return torch.cat(pieces).clone()

    def read_full(self, name: str, state: str = "param") -> torch.Tensor:
        if state == "param" and self._name(name) not in self._layout:  # a buffer
            return self.module[self._name(name)].clone()
        return self.read(name, state).reshape(self.shape(name))

    def _whole(self, name: str, state: str) -> torch.Tensor:
        if state == "param":
            return self.module[name]
        opt = self.model.get("optimizer") or {}
        order = [n for n in self.module if n not in self.buffers]
        if self.shapes:
            order = [n for g in self.shapes for n in g]
        index = order.index(name)
        return opt["state"][index][state]

    @property
    def world_size(self) -> int | None:
        return None  # DeepSpeed saves no RNG streams: nothing per rank to restore

    @property
    def meta(self) -> dict[str, Any]:
        steps = int(self.model.get("global_steps") or 0)
        return {
            "global_steps": steps,
            "micro_steps": None,  # not kept by DeepSpeed: the loader counts this run's gas
            "skipped_steps": int(self.model.get("skipped_steps") or 0),
            "data_loader": None,
            "client_state": {k: v for k, v in self.model.items() if k not in DS_KEYS},
        }

    def rank_state(self, rank: int) -> dict[str, Any]:
        if self.zero_stage == 0:
            opt = self.model.get("optimizer") or {}
            groups = opt.get("param_groups") or []
            state = next(iter((opt.get("state") or {}).values()), {})
            scaler = None
        else:
            sd = self.optim[0]
            opt = sd["optimizer_state_dict" if self.zero_stage == 3 else "base_optimizer_state"]
            groups = opt.get("param_groups") or []
            state = next(iter(opt["state"].values()), {})
            scaler = sd.get("loss_scaler")
        step = state.get("step")
        return {
            "optimizer_step": [] if step is None else [float(step)],
            "param_groups": [
                {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k in HYPER}
                for g in groups
            ],
            "scaler": _scaler(scaler),
            "scheduler": self.model.get("lr_scheduler"),
        }

    def close(self) -> None:
        self.model, self.module, self.optim = {}, {}, []

    def __enter__(self) -> DeepSpeedSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _slice_concat(vectors: list[torch.Tensor], start: int, numel: int) -> torch.Tensor:
    """Elements [start, start + numel) of ``vectors`` end to end, without joining them."""
    out, pos = [], 0
    for v in vectors:
        n = v.numel()
        lo, hi = max(start, pos), min(start + numel, pos + n)
        if lo < hi:
            out.append(v.reshape(-1)[lo - pos : hi - pos])
        pos += n
    return out[0] if len(out) == 1 else torch.cat(out)


def _scaler(record: Any) -> dict[str, Any] | None:
    """DeepSpeed's loss scaler in meshtrain's ``LossScaler.state_dict`` terms (fp16 only:
    a static scale of 1, what bf16 and fp32 runs carry, is meshtrain's disabled scaler)."""
    if not isinstance(record, LossScalerRecord):
        return None
    d = record.as_dict()
    if not d.get("dynamic", "cur_iter" in d) and float(d.get("cur_scale", 1.0)) == 1.0:
        return None
    out = {"scale": float(d.get("cur_scale", 1.0))}
    if "cur_hysteresis" in d:
        out["hysteresis_left"] = int(d["cur_hysteresis"])
    return out

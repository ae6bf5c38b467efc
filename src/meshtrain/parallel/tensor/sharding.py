"""How one full tensor maps to its tensor-parallel shards, and back.

A sharded dimension of size ``blocks x units x unit`` is cut per *unit* (an attention
head of ``unit = head_dim`` channels, one vocabulary row, one MLP channel). When ``T``
does not divide ``units`` each block is padded with zero units up to
``padded = ceil(units / T) x T``; rank ``r`` then holds units ``[r u, (r + 1) u)`` of
every block, ``u = padded / T``, so its local size along the dimension is
``blocks x u x unit`` (exactly ``1/T`` of the padded tensor). ``blocks > 1`` describes a
fused projection such as GPT-2's ``c_attn`` (q, k, v side by side): each of the three
blocks is split on its own, so a rank holds matching q, k and v heads.

Zero units are inert: a zero attention head has zero value rows and zero output columns,
a zero MLP channel has zero in and out weights, a zero vocabulary row is never looked up
and its logit is masked in the vocab-parallel loss. Their gradients are zero, so AdamW
keeps them at zero; ``unshard`` drops them, so ``full_state_dict`` (and checkpoints)
always hold the unpadded, unsharded tensors of the original model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshtrain.distributed import comm
from meshtrain.distributed.comm import Group


@dataclass(frozen=True)
class ShardSpec:
    """One sharded dimension: ``dim`` of size ``blocks * units * unit`` over ``size`` ranks."""

    dim: int
    units: int
    unit: int = 1
    blocks: int = 1
    size: int = 1  # tensor-parallel ranks

    @property
    def padded_units(self) -> int:
        return -(-self.units // self.size) * self.size

    @property
    def local_units(self) -> int:
        return self.padded_units // self.size

    @property
    def full(self) -> int:
        """Unpadded size of the dimension."""
        return self.blocks * self.units * self.unit

    @property
    def local(self) -> int:
        """Size of the dimension on one rank."""
        return self.blocks * self.local_units * self.unit

    @property
    def padding(self) -> int:
        return self.padded_units - self.units

    def first_unit(self, rank: int) -> int:
        return rank * self.local_units


def shard_tensor(full: torch.Tensor, spec: ShardSpec, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the unpadded ``full`` tensor (a new contiguous tensor)."""
    x = full.movedim(spec.dim, 0)
    rest = x.shape[1:]
    if x.shape[0] != spec.full:
        raise ValueError(f"dimension {spec.dim} is {x.shape[0]}, expected {spec.full} ({spec})")
    x = x.reshape(spec.blocks, spec.units, spec.unit, *rest)
    if spec.padding:
        pad = x.new_zeros(spec.blocks, spec.padding, spec.unit, *rest)
        x = torch.cat((x, pad), dim=1)
    u = spec.local_units
    x = x[:, rank * u : (rank + 1) * u].reshape(spec.local, *rest)
    # clone, not contiguous(): a shard along dim 0 is already a contiguous view, and keeping
    # it would keep the whole unsharded storage alive (69.2M decoder at tp 2: +99 MiB a rank)
    return x.movedim(0, spec.dim).clone(memory_format=torch.contiguous_format)


def unshard_pieces(pieces: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The unpadded full tensor from every rank's shard (in rank order)."""
    xs = [p.movedim(spec.dim, 0) for p in pieces]
    rest = xs[0].shape[1:]
    xs = [x.reshape(spec.blocks, spec.local_units, spec.unit, *rest) for x in xs]
    x = torch.cat(xs, dim=1)[:, : spec.units]
    return x.reshape(spec.full, *rest).movedim(0, spec.dim).contiguous()


def full_shape(local_shape: tuple[int, ...], spec: ShardSpec) -> tuple[int, ...]:
    """The unpadded, unsharded shape of a shard of ``local_shape``."""
    shape = list(local_shape)
    shape[spec.dim] = spec.full
    return tuple(shape)


def full_runs(
    spec: ShardSpec, local_shape: tuple[int, ...], rank: int, start: int, numel: int
) -> list[tuple[int, int, int]]:
    """Map flat elements ``[start, start + numel)`` of rank ``rank``'s shard to the FULL
    tensor's flat index space: ``[(offset from start, full flat index, length), ...]``,
    maximal contiguous runs, padding elements left out. Checkpoints name their pieces
    this way so any tensor-parallel size can read them.

    Computed per *piece*, not per element: a dozen int64 index tensors the size of the
    range (65 MiB each for a tp 4 rank's embedding shard of the 1 GB benchmark Llama)
    grew a sliced load's read loop by up to 0.2 x the model per rank. In each
    block of each outer index (the dimensions before ``dim``), the rank's real units are
    one run of ``valid x inner`` elements in both index spaces (``inner``: the product of
    the dimensions after ``dim``), followed by its padding units, if any."""
    if numel <= 0:
        return []
    d = spec.dim
    inner = 1
    for n in local_shape[d + 1 :]:
        inner *= n
    ld = local_shape[d]
    per_block = spec.local_units * spec.unit  # along dim, per block, on this rank
    valid = max(0, min(spec.local_units, spec.units - rank * spec.local_units)) * spec.unit
    first = rank * spec.local_units * spec.unit  # this rank's first index in a full block
    end = start + numel
    runs: list[tuple[int, int, int]] = []
    if valid == 0:
        return runs
    for outer in range(start // (ld * inner), (end - 1) // (ld * inner) + 1):
        for blk in range(spec.blocks):
            lo = outer * ld * inner + blk * per_block * inner  # local flat index
            hi = lo + valid * inner
            s, e = max(lo, start), min(hi, end)
            if s >= e:
                continue
            f = outer * spec.full * inner + (blk * spec.units * spec.unit + first) * inner
            f += s - lo
            if runs and runs[-1][0] + runs[-1][2] == s - start and runs[-1][1] + runs[-1][2] == f:
                off, f0, n = runs[-1]
                runs[-1] = (off, f0, n + e - s)
            else:
                runs.append((s - start, f, e - s))
    return runs


def specs_by_param(model: torch.nn.Module) -> dict[int, ShardSpec]:
    """``{id(param): ShardSpec}`` of every tensor-parallel-sharded parameter."""
    return {
        id(getattr(module, name)): spec
        for module in model.modules()
        for name, spec in getattr(module, "tp_specs", {}).items()
    }


def unshard_tensor(local: torch.Tensor, spec: ShardSpec, group: Group) -> torch.Tensor:
    """All-gather ``local`` over ``group`` and return the unpadded full tensor.

    Recorded under the label ``"state_dict"`` so training traffic figures stay exact.
    """
    local = local.detach().contiguous()
    out = torch.empty(group.size * local.numel(), dtype=local.dtype, device=local.device)
    comm.all_gather(out, local.view(-1), group, label="state_dict")
    return unshard_pieces(list(out.view(group.size, *local.shape).unbind(0)), spec)


def tp_specs(model: torch.nn.Module) -> dict[str, ShardSpec]:
    """``{state-dict key: ShardSpec}`` of every tensor-parallel parameter in ``model``."""
    out: dict[str, ShardSpec] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, spec in getattr(module, "tp_specs", {}).items():
            out[f"{prefix}.{name}" if prefix else name] = spec
    return out


def sharded_parameter_ids(model: torch.nn.Module) -> set[int]:
    """``id`` of every parameter that tensor parallelism sharded (the rest is replicated)."""
    return {
        id(getattr(module, name))
        for module in model.modules()
        for name in getattr(module, "tp_specs", {})
    }


def full_state_dict(model: torch.nn.Module, group: Group) -> dict[str, torch.Tensor]:
    """The model's state dict with every tensor-parallel shard gathered and unpadded.

    Every rank of ``group`` must call it (it all-gathers). Keys and shapes equal those of
    the model before ``apply_tensor_parallel``.
    """
    specs = tp_specs(model)
    out = {}
    for key, value in model.state_dict().items():
        spec = specs.get(key)
        out[key] = value if spec is None else unshard_tensor(value, spec, group)
    return out


__all__ = [
    "ShardSpec",
    "full_runs",
    "full_shape",
    "full_state_dict",
    "specs_by_param",
    "shard_tensor",
    "sharded_parameter_ids",
    "tp_specs",
    "unshard_pieces",
    "unshard_tensor",
]

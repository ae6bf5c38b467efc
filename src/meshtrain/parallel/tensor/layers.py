"""Column- and row-parallel linear layers and the vocab-parallel embedding.

Each layer is built FROM an existing module (``nn.Linear``, ``transformers``' ``Conv1D``
with its ``[in, out]`` weight, ``nn.Embedding``) by slicing that module's weights, so at
``T = 1`` it computes exactly what the original did and at ``T > 1`` the ranks together
compute the same function. Parameters keep their names (``weight``, ``bias``) so state
dict keys do not change; ``tp_specs`` on each layer says how to gather them back
(``sharding.full_state_dict``). ``x``: ``[batch, seq, in]``, ``b_x`` its bytes;
``T`` ranks; ``sp``: sequence parallelism.

============================  ==================  ==================  =====================
layer (weight ``W``)          sharded             forward collective  backward collective
============================  ==================  ==================  =====================
ColumnParallelLinear          ``W`` rows (out),   none (input comm    all-reduce of dx
``y_r = x W_r^T + b_r``       bias                done once by the    (2 b_x); sp:
                                                  region or here:     reduce-scatter (b_x)
                                                  sp: all-gather b_x)
RowParallelLinear             ``W`` columns (in)  all-reduce of y     none; sp: all-gather
``y = sum_r x_r W_r^T + b``   (bias replicated)   (2 b_y); sp:        of dy (b_y); the
                                                  reduce-scatter b_y  bias grad all-reduced
VocabParallelEmbedding        rows (vocabulary)   all-reduce of y     none; sp: all-gather
``y = sum_r E_r[ids]``                            (2 b_y); sp:        (b_y)
                                                  reduce-scatter b_y
============================  ==================  ==================  =====================

A column layer followed by a row layer (attention: q/k/v then o; MLP: up then down) is
one tensor-parallel region: one collective in and one out per direction. A column layer
whose input was already entered by the region (``input_is_parallel``) communicates
nothing itself, so q, k and v share one backward all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.distributed.comm import Group
from meshtrain.parallel.tensor import mappings as M
from meshtrain.parallel.tensor.sharding import ShardSpec, shard_tensor

SharedParams = dict[int, nn.Parameter]


def is_conv1d(module: nn.Module) -> bool:
    """``transformers.pytorch_utils.Conv1D`` (GPT-2): a linear layer with an [in, out] weight."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _shard_param(
    p: nn.Parameter, spec: ShardSpec, rank: int, shared: SharedParams | None
) -> nn.Parameter:
    """The shard of ``p`` as a new Parameter; a tied parameter is sharded once.

    A parameter marked ``meshtrain_values_follow`` (``meshtrain.from_pretrained``: the
    loader writes every element of it after the layout) gets an uninitialised shard
    instead of a copy: copying its untouched storage would write, and so make resident,
    a whole slice per rank that the loader then overwrites."""
    if shared is not None and id(p) in shared:
        return shared[id(p)]
    if getattr(p, "meshtrain_values_follow", False) and not spec.padding:
        shape = list(p.shape)
        shape[spec.dim] = spec.local
        data = torch.empty(shape, dtype=p.dtype, device=p.device)
    else:
        data = shard_tensor(p.detach(), spec, rank)
    new = nn.Parameter(data, requires_grad=p.requires_grad)
    if shared is not None:
        shared[id(p)] = new
    return new


def _dims(module: nn.Module) -> tuple[int, int, bool]:
    """(in_features, out_features, transposed) of a Linear or Conv1D."""
    if is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1], True
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    raise TypeError(f"{type(module).__name__} is not nn.Linear or transformers Conv1D")


def _spec(size: int, dim: int, units: int | None, blocks: int, t: int) -> ShardSpec:
    units = units or size // blocks
    if size % (blocks * units):
        raise ValueError(f"size {size} is not {blocks} blocks of {units} equal units")
    return ShardSpec(dim=dim, units=units, unit=size // (blocks * units), blocks=blocks, size=t)


class _ParallelLinear(nn.Module):
    def __init__(self, group: Group, transposed: bool, sequence_parallel: bool, seq_dim: int):
        super().__init__()
        self.group = group
        self.transposed = transposed
        self.sequence_parallel = sequence_parallel
        self.seq_dim = seq_dim
        self.tp_specs: dict[str, ShardSpec] = {}

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.transposed:  # Conv1D: x @ W, W [in, out]
            y = torch.matmul(x, self.weight)
            return y if bias is None else y + bias
        return F.linear(x, self.weight, bias)


class ColumnParallelLinear(_ParallelLinear):
    """``y_r = x W_r^T + b_r``: this rank's slice of the output features (see module doc)."""

    input_is_parallel: bool

    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        group: Group,
        *,
        units: int | None = None,
        blocks: int = 1,
        sequence_parallel: bool = False,
        input_is_parallel: bool = False,
        seq_dim: int = 1,
        shared: SharedParams | None = None,
    ) -> ColumnParallelLinear:
        """Slice ``module`` (Linear or Conv1D) by output features.

        ``units``: how many indivisible units the outputs hold (heads; default: every
        feature), padded with zero units to a multiple of T; ``blocks``: fused projections
        side by side (3 for a q/k/v ``c_attn``), each split on its own.
        """
        fan_in, fan_out, transposed = _dims(module)
        self = cls(group, transposed, sequence_parallel, seq_dim)
        self.input_is_parallel = input_is_parallel
        self.in_features = fan_in
        spec = _spec(fan_out, 1 if transposed else 0, units, blocks, group.size)
        self.out_features = spec.local
        self.weight = _shard_param(module.weight, spec, group.rank, shared)
        self.tp_specs["weight"] = spec
        if module.bias is not None:
            bspec = ShardSpec(0, spec.units, spec.unit, spec.blocks, spec.size)
            self.bias = _shard_param(module.bias, bspec, group.rank, shared)
            self.tp_specs["bias"] = bspec
        else:
            self.register_parameter("bias", None)
        return self

    gather_output: bool = False  # generation: every rank gets the full, unpadded output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            if self.sequence_parallel:
                x = M.gather_from_sequence(x, self.group, self.seq_dim)
            else:
                x = M.copy_to_region(x, self.group)
        y = self._matmul(x, self.bias)
        if self.gather_output:  # all-gather of the [..., out/T] shards: b_y per call
            y = M.gather_from_region(y, self.group, dim=-1)[..., : self.tp_specs["weight"].full]
        return y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features} (of {self.tp_specs['weight'].full}),"
            f" tp={self.group.size}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(_ParallelLinear):
    """``y = sum_r x_r W_r^T + b``: this rank's slice of the input features."""

    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        group: Group,
        *,
        units: int | None = None,
        blocks: int = 1,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        shared: SharedParams | None = None,
    ) -> RowParallelLinear:
        """Slice ``module`` (Linear or Conv1D) by input features (``units``: heads...)."""
        fan_in, fan_out, transposed = _dims(module)
        self = cls(group, transposed, sequence_parallel, seq_dim)
        spec = _spec(fan_in, 0 if transposed else 1, units, blocks, group.size)
        self.in_features, self.out_features = spec.local, fan_out
        self.weight = _shard_param(module.weight, spec, group.rank, shared)
        self.tp_specs["weight"] = spec
        self.bias = module.bias  # replicated, added once after the reduction
        self.param_hooks = []  # removed with the layer (``restore``)
        if self.bias is not None and sequence_parallel and group.size > 1:
            # added on a sequence shard: each rank's gradient covers its tokens only
            self.param_hooks.append(self.bias.register_hook(M.reduce_gradient_hook(group)))
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, None)
        if self.sequence_parallel:
            y = M.reduce_scatter_to_sequence(y, self.group, self.seq_dim)
        else:
            y = M.reduce_from_region(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features} (of {self.tp_specs['weight'].full}), out={self.out_features},"
            f" tp={self.group.size}, sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """Rows ``[r V/T, (r + 1) V/T)`` of the table on rank ``r``; other ids give zeros and
    the all-reduce (or, with sequence parallelism, reduce-scatter) sums the ranks."""

    @classmethod
    def from_module(
        cls,
        module: nn.Embedding,
        group: Group,
        *,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        shared: SharedParams | None = None,
    ) -> VocabParallelEmbedding:
        if module.max_norm is not None or module.sparse:
            raise ValueError("VocabParallelEmbedding does not support max_norm or sparse")
        self = cls()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.seq_dim = seq_dim
        spec = ShardSpec(dim=0, units=module.num_embeddings, size=group.size)
        self.num_embeddings = module.num_embeddings  # the real vocabulary
        self.embedding_dim = module.embedding_dim
        self.start = spec.first_unit(group.rank)
        self.end = self.start + spec.local_units
        pad = module.padding_idx
        self.local_padding_idx = (
            pad - self.start if pad is not None and self.start <= pad < self.end else None
        )
        self.weight = _shard_param(module.weight, spec, group.rank, shared)
        self.tp_specs = {"weight": spec}
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        y = F.embedding(local, self.weight, self.local_padding_idx)
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return M.reduce_scatter_to_sequence(y, self.group, self.seq_dim)
        return M.reduce_from_region(y, self.group)

    def extra_repr(self) -> str:
        return (
            f"rows [{self.start}, {self.end}) of {self.num_embeddings}, dim={self.embedding_dim},"
            f" tp={self.group.size}, sequence_parallel={self.sequence_parallel}"
        )


__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "is_conv1d",
]

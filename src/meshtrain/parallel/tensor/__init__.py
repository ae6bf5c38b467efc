"""Tensor parallelism (Megatron-style): mappings, parallel layers, vocab-parallel loss,
plans per model family and ``apply_tensor_parallel``. See docs/tensor_parallel.md."""

from meshtrain.parallel.tensor.apply import apply_tensor_parallel
from meshtrain.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from meshtrain.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from meshtrain.parallel.tensor.plans import PLANS, TPPlan, plan_for
from meshtrain.parallel.tensor.restore import remove_tensor_parallel
from meshtrain.parallel.tensor.sharding import ShardSpec, full_state_dict, tp_specs

__all__ = [
    "PLANS",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ShardSpec",
    "TPPlan",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "full_state_dict",
    "plan_for",
    "remove_tensor_parallel",
    "tp_specs",
    "vocab_parallel_cross_entropy",
]

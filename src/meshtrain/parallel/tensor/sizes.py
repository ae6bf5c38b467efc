"""Per-rank parameter counts under tensor parallelism, without processes.

What a rank holds after ``apply_tensor_parallel`` at size ``T``: for every parameter the
plan shards (embedding / column / row / lm_head weights, column biases) its padded size
``/ T`` (``sharding.ShardSpec``); every other parameter whole, and so every parameter
inside a mixture-of-experts block (``moe_blocks``: router, experts and shared experts stay
whole over tp, as ``apply_tensor_parallel`` leaves them). Used by
``meshtrain estimate`` and ``estimate.model_states_bytes`` for a model, where dividing
the whole count by ``T`` would undercount the replicated norms and biases and ignore
padding.
"""

from __future__ import annotations

import fnmatch

from torch import nn

from meshtrain.parallel.tensor.moe_blocks import inside, moe_blocks
from meshtrain.parallel.tensor.plans import TPPlan, plan_for

_SHARDED = ("embedding", "embedding_to_sequence", "column", "row", "lm_head")


def local_parameter_counts(
    model: nn.Module, tp: int, plan: TPPlan | None = None
) -> tuple[int, int]:
    """(trainable, frozen) elements one rank holds at tensor-parallel size ``tp``;
    tied parameters count once. Raises ``ValueError`` when the model has no plan."""
    plan = plan or plan_for(model)
    if plan is None:
        raise ValueError(f"no tensor-parallel plan for {type(model).__name__}")
    sizes = {}
    for key, path in plan.sizes.items():
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part)
        sizes[key] = int(obj)
    local: dict[int, int] = {}  # id(param) -> elements on one rank
    moe = moe_blocks(model)
    for name, mod in model.named_modules():
        if inside(name, moe):
            continue
        for row in plan.rows:
            if row[1] not in _SHARDED or not fnmatch.fnmatchcase(name, row[0]):
                continue
            units = sizes[row[2]] if len(row) > 2 else None
            blocks = row[3] if len(row) > 3 else 1
            is_conv = type(mod).__name__ == "Conv1D"
            if row[1] == "row":
                dim = 0 if is_conv else 1
                targets = [mod.weight]
            else:
                dim = 1 if is_conv else 0
                targets = [mod.weight] + (
                    [mod.bias]
                    if row[1] != "embedding" and getattr(mod, "bias", None) is not None
                    else []
                )
            for p in targets:
                d = dim if p is mod.weight else 0
                size = p.shape[d]
                n_units = units or size // blocks
                unit = size // (blocks * n_units)
                padded = blocks * -(-n_units // tp) * tp * unit
                local[id(p)] = p.numel() // size * padded // tp
    seen: dict[int, nn.Parameter] = {}
    for p in model.parameters():
        seen.setdefault(id(p), p)
    trainable = sum(local.get(i, p.numel()) for i, p in seen.items() if p.requires_grad)
    frozen = sum(local.get(i, p.numel()) for i, p in seen.items() if not p.requires_grad)
    return trainable, frozen


__all__ = ["local_parameter_counts"]

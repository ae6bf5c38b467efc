"""The room of transformers' mixture-of-experts families: Mixtral (``mixtral``), Qwen2-MoE
(``qwen2_moe``) and Qwen3-MoE (``qwen3_moe``).

Llama-style attention with a sparse MoE block at ``model.layers.*.mlp`` (router ``gate``,
fused ``experts``, Qwen2-MoE's shared expert). Tensor parallelism shards the attention and
leaves every MoE block whole (``parallel.tensor.moe_blocks``; the plans' mlp rows shard
Qwen-MoE's dense ``mlp_only_layers``); expert parallelism shards the experts modules named
here (``parallel.experts.shard``). Context parallelism is proven on Mixtral only.
"""

from __future__ import annotations

from meshtrain.families.llama import LLAMA_BODY, LLAMA_LAYOUT, LLAMA_SIZES
from meshtrain.families.room import Room
from meshtrain.families.tp_plan import TPPlan

LLAMA_MOE = TPPlan(  # Llama-style attention; the MoE block at ``mlp`` stays whole
    name="llama-style mixture of experts",
    classes=("MixtralForCausalLM", "Qwen2MoeForCausalLM"),
    sizes=LLAMA_SIZES,
    # the mlp rows shard Qwen-MoE's dense layers (``mlp_only_layers``); MoE blocks are
    # skipped whatever the rows say (``moe_blocks``)
    rows=(*LLAMA_BODY, ("lm_head", "lm_head", "vocab")),
    loss="hf_causal",
)

QWEN3_MOE = TPPlan(  # as LLAMA_MOE, plus the per-head query/key norms
    name="qwen3 mixture of experts",
    classes=("Qwen3MoeForCausalLM",),
    sizes=LLAMA_SIZES,
    rows=(
        *LLAMA_BODY,
        ("model.layers.*.self_attn.q_norm", "per_head"),
        ("model.layers.*.self_attn.k_norm", "per_head"),
        ("lm_head", "lm_head", "vocab"),
    ),
    loss="hf_causal",
)

ROOM = Room(
    name="mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE)",
    model_types=("mixtral", "qwen2_moe", "qwen3_moe"),
    tp_plans=(LLAMA_MOE, QWEN3_MOE),
    layout=LLAMA_LAYOUT,
    context_types=("mixtral",),
    # what each block around them does: Mixtral softmax -> top-k -> renormalise; Qwen2-MoE
    # softmax -> top-k (-> renormalise with norm_topk_prob) + a sigmoid-gated shared
    # expert; Qwen3-MoE as Qwen2-MoE without the shared expert
    expert_classes=("MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts"),
)

__all__ = ["LLAMA_MOE", "QWEN3_MOE", "ROOM"]

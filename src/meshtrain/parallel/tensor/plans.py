"""Which tensor-parallel plan a model gets: the built-in plan naming its class, from the
family rooms (``meshtrain.families``), or the plan it assembles itself.

A plan is a ``TPPlan`` (``meshtrain.families.tp_plan``: the table of rows and the styles
``apply_tensor_parallel`` knows). Each family's room declares its plans; ``PLANS`` is
every room's plans in room order, and ``plan_for`` looks the model's class name up in
them. The plans keep their names here too (``LLAMA``, ``GPT2``, ...), where users and
tests import them from.

A plan for your own model: ``meshtrain.families.tp_plan``'s docstring shows one.
"""

from __future__ import annotations

from torch import nn

from meshtrain.errors import ConfigError
from meshtrain.families.bert import BERT, BERT_MLM, BERT_TOKENS
from meshtrain.families.decoder import DECODER
from meshtrain.families.gpt2 import GPT2, GPT2_CLASSIFIER
from meshtrain.families.llama import LLAMA, LLAMA_CLASSIFIER
from meshtrain.families.mixture_of_experts import LLAMA_MOE, QWEN3_MOE
from meshtrain.families.rooms import ROOMS
from meshtrain.families.tp_plan import STYLES, Row, TPPlan
from meshtrain.parallel.tensor.layers import is_conv1d

PLANS: tuple[TPPlan, ...] = tuple(plan for room in ROOMS for plan in room.tp_plans)


def plan_for(model: object) -> TPPlan | None:
    """The built-in plan whose ``classes`` name ``model``'s class, else the plan a model
    assembles itself from its layers (``tensor_parallel_plan()``: a PipelineModule's,
    ``layer_plans``), else None."""
    own = getattr(model, "tensor_parallel_plan", None)
    if callable(own):
        return own()
    name = type(model).__name__
    for plan in PLANS:
        if name in plan.classes:
            return plan
    return None


# the styles after which activations are sequence shards (sequence parallelism needs one)
SEQUENCE_ENTRIES = ("embedding_to_sequence", "scatter_sequence")


def check_sequence_parallel(plan: TPPlan) -> None:
    """Refuse ``plan`` under sequence parallelism when it cannot run it."""
    if not plan.sequence_parallel:
        raise ConfigError(
            f"tensor_parallel.sequence_parallel: the {plan.name!r} plan does not support "
            "sequence parallelism; set it to false"
        )
    if not any(row[1] in SEQUENCE_ENTRIES for row in plan.rows):
        raise ConfigError(
            f"tensor_parallel.sequence_parallel: the {plan.name!r} plan has no row that "
            f"splits the sequence over the tp ranks (a style of {list(SEQUENCE_ENTRIES)}), "
            "so its row-parallel layers would get whole activations where they expect "
            "sequence shards; add one at the input embedding (or the first block's input), "
            "or set sequence_parallel to false"
        )


def sample_names(model, limit: int = 12) -> list[str]:
    """Names of the first ``limit`` linear / embedding / Conv1D modules (for messages)."""
    names = [
        n
        for n, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding)) or is_conv1d(m)
    ]
    return names[:limit] + (["..."] if len(names) > limit else [])


def no_plan_message(model) -> str:
    """The error for a model without a plan: its module names and how to write one."""
    names = sample_names(model, limit=16)
    return (
        f"tensor parallelism has no plan for {type(model).__name__} (built-in plans: the "
        f"meshtrain decoder, Llama/Qwen2/Mistral, Mixtral/Qwen2-MoE/Qwen3-MoE, GPT-2, "
        f"BERT). Its linear and embedding "
        f"modules are: {', '.join(names)}. Write a plan naming them, e.g.\n"
        "    from meshtrain.parallel.tensor import TPPlan\n"
        "    plan = TPPlan(name='mine', sizes={'heads': 'config.n_heads'}, rows=(\n"
        "        ('blocks.*.attn', 'region'),\n"
        "        ('blocks.*.attn.q_proj', 'column', 'heads'), ... ,\n"
        "        ('blocks.*.attn.out_proj', 'row', 'heads'),\n"
        "        ('blocks.*.mlp.up', 'column'), ('blocks.*.mlp.down', 'row')))\n"
        "and pass it as meshtrain.initialize(..., tp_plan=plan) or apply_tensor_parallel("
        "model, topology, config, plan=plan) (see docs/tensor_parallel.md)"
    )


__all__ = [
    "BERT",
    "BERT_MLM",
    "BERT_TOKENS",
    "DECODER",
    "GPT2",
    "GPT2_CLASSIFIER",
    "LLAMA",
    "LLAMA_CLASSIFIER",
    "LLAMA_MOE",
    "PLANS",
    "QWEN3_MOE",
    "SEQUENCE_ENTRIES",
    "STYLES",
    "Row",
    "TPPlan",
    "check_sequence_parallel",
    "no_plan_message",
    "plan_for",
    "sample_names",
]

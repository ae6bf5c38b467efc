"""What meshtrain's per-family tables answer, model class by model class: the lookups the
TP plan table, the TP block table (PipelineModule layers), the pipeline layouts, context
parallelism, expert sharding, packing and the activation estimate made before the rooms
(``meshtrain.families``) held them.

``tables()`` asks only names that exist on both sides of the change (``plan_for``,
``kind_of``, ``LAYOUTS``, ``check_context_parallel``, ``shard.FAMILIES``,
``PACKING_FAMILIES``, ``DecoderDims.of``), so the same function ran on the tree before the
rooms (main at 782d58d) to write ``tables_before_rooms.json``::

    PYTHONPATH=<tree before>/src python -m tests.families.family_tables > tests/families/tables_before_rooms.json
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

# every model class name a built-in TP plan named before the rooms, and a few it did not
TP_CLASSES = (
    "Decoder", "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM",
    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
    "LlamaForSequenceClassification", "Qwen2ForSequenceClassification",
    "MistralForSequenceClassification", "GPT2LMHeadModel", "GPT2ForSequenceClassification",
    "BertModel", "BertForSequenceClassification", "BertForTokenClassification",
    "BertForMaskedLM", "Qwen3ForCausalLM", "OPTForCausalLM", "GemmaForCausalLM",
)  # fmt: skip
# every block class the PipelineModule TP table named, and one it did not
BLOCK_CLASSES = (
    "transformers.models.llama.modeling_llama.LlamaDecoderLayer",
    "transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer",
    "transformers.models.mistral.modeling_mistral.MistralDecoderLayer",
    "transformers.models.gpt2.modeling_gpt2.GPT2Block",
    "meshtrain.models.decoder.Block",
    "transformers.models.bert.modeling_bert.BertLayer",
)
# transformers model types asked of context parallelism, packing and the estimate
MODEL_TYPES = (
    "llama", "qwen2", "qwen3", "mistral", "gpt2", "bert", "mixtral", "qwen2_moe",
    "qwen3_moe", "gemma", "olmo", "gpt_neox", "opt", "phi3",
)  # fmt: skip


def _named(qualified: str) -> object:
    module, _, name = qualified.rpartition(".")
    return type(name, (), {"__module__": module or "tests", "__qualname__": name})()


def _plan(plan) -> dict | None:
    if plan is None:
        return None
    return {
        "name": plan.name,
        "rows": [list(r) for r in plan.rows],
        "sizes": dict(plan.sizes),
        "attrs": [list(a) for a in plan.attrs],
        "loss": plan.loss,
        "sequence_parallel": plan.sequence_parallel,
    }


def _context(model) -> str:
    from meshtrain.errors import ConfigError
    from meshtrain.parallel.context.apply import check_context_parallel

    topology = SimpleNamespace(cp_size=2)
    config = SimpleNamespace(loss=SimpleNamespace(chunked=False))
    try:
        return check_context_parallel(model, topology, config)
    except ConfigError:
        return "refused"


def _dims(model_type: str | None) -> bool:
    from meshtrain.estimate.activations import DecoderDims

    cfg = SimpleNamespace(
        model_type=model_type, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=100, num_hidden_layers=2,
    )  # fmt: skip
    return DecoderDims.of(SimpleNamespace(config=cfg)) is not None


def tables() -> dict:
    """Every lookup answer (module docstring), as plain JSON data."""
    from meshtrain.models import Decoder, DecoderConfig
    from meshtrain.models.packed_batches import PACKING_FAMILIES
    from meshtrain.parallel.experts import shard
    from meshtrain.parallel.pipeline.split import LAYOUTS
    from meshtrain.parallel.tensor.layer_plans import attrs_under, kind_of, rows_under
    from meshtrain.parallel.tensor.plans import plan_for

    blocks = {}
    for qualified in BLOCK_CLASSES:
        kind = kind_of(_named(qualified))
        if kind is not None:
            plan, prefix, sizes = kind
            kind = {
                "plan": plan.name,
                "prefix": prefix,
                "sizes": dict(sizes),
                "rows": [list(r) for r in rows_under(plan, prefix)],
                "attrs": [list(a) for a in attrs_under(plan, prefix)],
            }
        blocks[qualified] = kind
    decoder = Decoder(DecoderConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, ffn_dim=32))
    context = {"Decoder": _context(decoder)}
    for t in MODEL_TYPES:
        context[t] = _context(SimpleNamespace(config=SimpleNamespace(model_type=t)))
    return {
        "tensor_parallel": {c: _plan(plan_for(_named(f"tests.{c}"))) for c in TP_CLASSES},
        "tensor_parallel_blocks": blocks,
        "pipeline_layouts": [dataclasses.asdict(layout) for layout in LAYOUTS],
        "context_parallel": context,
        "expert_classes": list(shard.FAMILIES),
        "packing": sorted(PACKING_FAMILIES),
        "activation_estimate": {str(t): _dims(t) for t in (*MODEL_TYPES, None)},
    }


if __name__ == "__main__":
    print(json.dumps(tables(), indent=1, sort_keys=True))

"""Which modules tensor parallelism leaves whole in a mixture-of-experts model, and which
plan each MoE family gets (``parallel.tensor.moe_blocks``, ``plans``), in one process.
The distributed numbers are in ``tests/distributed/test_moe_tensor_parallel.py``."""

from __future__ import annotations

import pytest
from torch import nn

from meshtrain.errors import ConfigError
from meshtrain.parallel.tensor.moe_blocks import inside, moe_blocks
from meshtrain.parallel.tensor.plans import LLAMA, LLAMA_MOE, QWEN3_MOE, plan_for
from tests.distributed.test_moe import tiny_causal_lm, tiny_decoder


def test_moe_blocks_of_each_family():
    for model in (
        tiny_causal_lm("mixtral"),
        tiny_causal_lm("qwen2_moe"),
        tiny_causal_lm("qwen3_moe"),
    ):
        assert moe_blocks(model) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert moe_blocks(tiny_decoder()) == ["layers.0.mlp", "layers.1.mlp"]
    assert plan_for(tiny_causal_lm("mixtral")) is LLAMA_MOE
    assert plan_for(tiny_causal_lm("qwen2_moe")) is LLAMA_MOE
    assert plan_for(tiny_causal_lm("qwen3_moe")) is QWEN3_MOE


def test_blocks_cover_everything_inside_them_only():
    blocks = moe_blocks(tiny_causal_lm("qwen2_moe"))
    assert inside("model.layers.0.mlp", blocks)
    assert inside("model.layers.0.mlp.shared_expert.gate_proj", blocks)
    assert not inside("model.layers.0.mlp_norm", blocks)  # a prefix is not a parent
    assert not inside("model.layers.0.self_attn.q_proj", blocks)


def test_dense_models_and_other_expert_layouts():
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=1,
            num_attention_heads=2,
        )
    )
    assert moe_blocks(llama) == [] and plan_for(llama) is LLAMA

    class Block(nn.Module):  # an older layout: a list of expert MLPs called ``experts``
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(4, 2)
            self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    model = nn.Sequential(Block(), Block())
    assert moe_blocks(model) == ["0", "1"]  # tp leaves the block whole, ep or not

    with pytest.raises(ConfigError, match="experts at the top of the model"):
        moe_blocks(nn.ModuleDict({"experts": nn.ModuleList([nn.Linear(2, 2)])}))

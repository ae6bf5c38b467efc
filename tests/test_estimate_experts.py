"""``meshtrain estimate --ep``: expert and non-expert parameters per rank, and the ZeRO
formula applied to each part with its own degree (``meshtrain.estimate.experts``).

Every number is exact: the counts come from the model's shapes, and the byte figures are
the ZeRO-paper formula with N_d = dp for non-expert and dp / ep for expert parameters.
"""

from __future__ import annotations

import pytest
import torch

from meshtrain.cli import main
from meshtrain.errors import ConfigError
from meshtrain.estimate.experts import split_expert_params
from meshtrain.estimate.model_states import ModelStates, estimate_table, model_states_bytes

D, E = 45 * 10**9, 2 * 10**9  # a Mixtral-8x7B-like split: experts 45e9, the rest 2e9


def test_each_part_partitioned_over_its_own_degree():
    total = D + E
    for stage in (0, 1, 2, 3):
        got = model_states_bytes(total, dp=8, stage=stage, ep=4, expert_params=D)
        dense = model_states_bytes(E, dp=8, stage=stage)
        experts = model_states_bytes(D // 4, dp=2, stage=stage)  # 1/ep per rank, over dp/ep
        want = ModelStates(
            *(getattr(dense, f) + getattr(experts, f) for f in ("params", "grads", "optimizer"))
        )
        assert got == want, stage
    s1 = model_states_bytes(total, dp=8, stage=1, ep=4, expert_params=D)
    assert s1.optimizer == 12 * E // 8 + 12 * (D // 4) // 2
    # ep = dp: every rank holds other experts, nothing left to partition them over
    s3 = model_states_bytes(total, dp=4, stage=3, ep=4, expert_params=D)
    assert s3.params == 2 * E // 4 + 2 * D // 4
    # ep 1 with experts named: the same bytes as without the split
    assert model_states_bytes(total, dp=8, stage=2, expert_params=D) == model_states_bytes(
        total, dp=8, stage=2
    )


def _tiny_qwen2_moe():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=12,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
    )
    with torch.device("meta"):
        return transformers.Qwen2MoeForCausalLM(cfg)


def test_counts_from_a_transformers_moe_model():
    model = _tiny_qwen2_moe()
    (dense, dense_frozen), (expert, expert_frozen) = split_expert_params(model)
    # per layer: gate_up (E, 2 x 8, 16) + down (E, 16, 8); the shared expert is replicated
    assert expert == 2 * 4 * (2 * 8 * 16 + 16 * 8)
    assert dense + expert == sum(p.numel() for p in model.parameters())
    assert dense_frozen == expert_frozen == 0
    table = estimate_table(model, dp=4, ep=2)
    assert f"{expert:,} expert parameters ({expert // 2:,} per rank" in table
    assert f"{dense:,} non-expert ({dense:,} per rank)" in table
    s = model_states_bytes(model, dp=4, stage=3, ep=2)
    assert s.params == 2 * (-(-dense // 4) + -(-(expert // 2) // 2))


def test_cli_ep(capsys):
    assert (
        main(["estimate", "--params", "47B", "--expert-params", "45B", "--dp", "8", "--ep", "4"])
        == 0
    )
    out = capsys.readouterr().out
    assert "ep=4: 45,000,000,000 expert parameters (11,250,000,000 per rank" in out
    assert "2,000,000,000 non-expert (2,000,000,000 per rank) = 13,250,000,000 per rank" in out
    # stage 1: 12 x 2e9 / 8 + 12 x 11.25e9 / 2 = 70.5e9 bytes of optimizer states
    assert [line for line in out.splitlines() if line.startswith("1 ")][0].split()[-4:-2] == [
        "70.5",
        "GB",
    ]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"ep": 3, "expert_params": D}, ["ep 3 must divide dp 8"]),
        ({"ep": 2}, ["no expert parameters", "--expert-params"]),
        ({"ep": 2, "expert_params": 10 * D}, ["expert_params", "between 0 and"]),
        ({"ep": 0, "expert_params": D}, ["ep: must be an integer >= 1"]),
    ],
)
def test_errors_name_the_argument(kwargs, words):
    with pytest.raises(ConfigError) as err:
        model_states_bytes(D + E, dp=8, stage=1, **kwargs)
    for w in words:
        assert w in str(err.value)

"""Expert-parallel building blocks in one process: routing, the auxiliary loss against
transformers', the grouped GEMM against the loop, the expert-bias update and the step log.

Tolerances (``tests/tolerance.py``): routing and the auxiliary loss compute the same fp32
expressions as transformers, in another summation order; grouped GEMM vs loop: the same
products summed in another blocking: both ``evaluation()`` relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtrain.distributed.comm import Group
from meshtrain.distributed.comm_stats import CommStats
from meshtrain.errors import ConfigError
from meshtrain.parallel.experts import gemm
from meshtrain.parallel.experts.aux_loss import load_balancing_loss
from meshtrain.parallel.experts.routing import check_routing, route, update_expert_bias
from tests.tolerance import evaluation

OUT = evaluation()


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_routing_matches_the_families():
    from transformers import MixtralConfig, Qwen2MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    torch.manual_seed(0)
    x = torch.randn(20, 16)
    for router, normalize in (
        (MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=8)), True),
        (Qwen2MoeTopKRouter(Qwen2MoeConfig(hidden_size=16, num_experts=8)), False),
    ):
        torch.nn.init.normal_(router.weight)
        with torch.no_grad():
            logits, w_ref, i_ref = router(x)
        w, i = route(logits, router.top_k, "softmax_topk", normalize)
        assert torch.equal(i, i_ref) and rel(w, w_ref) < OUT
    logits = torch.randn(20, 8)
    w, i = route(logits, 2, "topk_softmax")
    assert torch.equal(i, logits.topk(2).indices)
    assert rel(w, torch.softmax(logits.topk(2).values, -1)) < OUT
    w, i = route(logits, 3, "sigmoid_topk", normalize=True)
    s = torch.sigmoid(logits)
    assert torch.equal(i, s.topk(3).indices) and rel(w.sum(-1), torch.ones(20)) < OUT
    # the balance bias moves the choice, never the weights of the chosen experts
    bias = torch.zeros(8)
    bias[7] = 100.0
    w, i = route(logits, 2, "softmax_topk", normalize=False, bias=bias)
    assert (i[:, 0] == 7).all()
    assert rel(w, torch.softmax(logits, -1).gather(-1, i)) < OUT


def test_bad_routing_is_refused_by_name():
    with pytest.raises(ConfigError, match="model.moe.routing: 'top1'"):
        check_routing("top1", 8, 2)
    with pytest.raises(ConfigError, match="model.moe.top_k: 9 with 8 experts"):
        check_routing("softmax_topk", 8, 9)


def test_aux_loss_is_transformers_in_one_process():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(1)
    logits = tuple(torch.randn(12, 8) for _ in range(3))
    mask = torch.ones(3, 4)
    mask[0, :2] = 0
    for m in (None, mask):
        ours = load_balancing_loss(logits, 8, 2, m)
        theirs = load_balancing_loss_func(logits, 8, 2, m)
        assert rel(ours, theirs) < OUT, m


def test_grouped_gemm_equals_loop():
    """Including experts with no rows; ``choose`` runs once per layer and picks grouped
    where the kernel runs (fp32 on this CPU with torch 2.14)."""
    torch.manual_seed(2)
    gate_up = torch.randn(4, 2 * 12, 16, requires_grad=True)
    down = torch.randn(4, 16, 12, requires_grad=True)
    counts = [5, 0, 7, 0]
    x = torch.randn(sum(counts), 16, requires_grad=True)
    g = torch.randn(sum(counts), 16)
    outs = {}
    for impl in gemm.GEMMS:
        for t in (gate_up, down, x):
            t.grad = None
        y = gemm.SWIGLU[impl](x, gate_up, down, counts, F.silu)
        y.backward(g)
        outs[impl] = (y.detach(), x.grad.clone(), gate_up.grad.clone(), down.grad.clone())
    for a, b in zip(outs["grouped"], outs["loop"], strict=True):
        assert rel(a, b) < OUT
    assert (outs["loop"][2][1] == 0).all() and (outs["loop"][2][3] == 0).all()
    choice = gemm.choose(gate_up, down, F.silu)
    assert choice == ("grouped" if hasattr(torch, "_grouped_mm") else "loop")


def test_expert_load_bias_update_and_step_log():
    from meshtrain.engine.step_log import StepLog
    from meshtrain.models import Decoder, DecoderConfig
    from meshtrain.parallel.experts.load import ExpertLoad

    moe = dict(n_experts=4, top_k=1, bias_update_rate=0.1)
    model = Decoder(DecoderConfig(vocab_size=32, dim=8, n_layers=1, n_heads=2, ffn_dim=8, moe=moe))
    one = Group("dp", None, (0,), 0, CommStats())
    load = ExpertLoad.find(model, one)
    ids = torch.randint(0, 32, (2, 6))
    model(ids)
    model(ids)  # two micro-batches in one step
    counts = model.layers[0].mlp.experts.tokens_seen.clone()
    assert int(counts.sum()) == 2 * 12
    facts = load.end_step({("all_to_all", "ep"): 640, ("all_reduce", "dp"): 8})
    assert facts == {
        "tokens_per_expert_min": int(counts.min()),
        "tokens_per_expert_max": int(counts.max()),
        "all_to_all_bytes": 640,
    }
    bias = model.layers[0].mlp.expert_bias
    expected = torch.zeros(4)
    update_expert_bias(expected, counts, 0.1)
    assert torch.equal(bias, expected) and bias[counts.argmax()] < 0
    assert model.layers[0].mlp.experts.tokens_seen is None  # counted afresh next step
    log = StepLog(every=0, dp_size=1, is_logging_rank=True)
    last = log.end_step(
        step=1, lr=1e-3, loss_scale=1.0, grad_norm=1.0, comm_bytes=0, skipped=False, moe=facts
    )
    assert " | tokens/expert " in log.format(last) and "all-to-all 0.0 MB" in log.format(last)
    assert ExpertLoad.find(torch.nn.Linear(2, 2), one) is None

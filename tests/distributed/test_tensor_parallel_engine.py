"""Tensor parallelism through ``meshtrain.initialize``: 20 AdamW steps vs one process.

Layouts, each group of cases in one spawn: tp 2 (dp 1, ZeRO 0) with and without sequence
parallelism on the reference decoder and tiny transformers Llama, GPT-2, BERT (sequence
classification), BertForMaskedLM (vocab-parallel loss) and the Llama and GPT-2 sequence
classifiers (right-padded rows, so each row's head pools another token); tp 3 on Llama,
whose 4 key/value heads and 8 query heads are padded to 6 and 12 (sequence length 9 there, a
multiple of 3); tp 4 (4 processes) with and without sequence parallelism on the decoder
and Llama; tp 2 x dp 2 with ZeRO 1 and ZeRO 3. Two runs add activation checkpointing
(the blocks' tensor-parallel collectives run again in the recomputation).
Every rank builds the same model; data-parallel rank ``d`` takes rows ``[d m, (d + 1) m)``
of the same global batch (every row has the same number of ignored labels, so the mean
of the per-rank mean losses is the global mean). One run clips the gradient at a norm
the model exceeds, so the global norm (replicated parameters counted once, sharded ones
over the tp group) decides the update.

Tolerances (the suite's rule, ``tests/tolerance.py``): the two sides sum the same
products in another order (split matmuls, the reduction over tp), so per-step losses and
the final parameters (``engine.module_state_dict()``: unsharded, unpadded, normwise over
the whole model) are held to ``trajectory(1e-3, 20)`` = 1.3e-5 relative (measured across
kernels and thread counts: at most 1.4e-6, Llama's sequence classifier). Per tensor,
``per_tensor``: a small tensor (a bias, a norm) holds few of the elements whose Adam
update flips with the last bits of a nearly cancelling gradient, so its relative error
fluctuates by up to ``sqrt(N / n)`` around the model's. The gradient norm the engine
reports (the global norm: replicated parameters once, shards summed over tp) within
``evaluation()`` of ``clip_grad_norm_``'s at step 0, where both see identical weights (one
evaluation in another order), and within ``composed(trajectory, 2)`` over all 20 steps:
from step 1 on the two runs differentiate weights that already differ by up to the
parameter bound, through the forward and the backward maps.

Two runs train in bf16 (sequence parallel decoder at tp 2, sequence parallel Llama at tp
4) against the fp32 reference: loss and parameters within 2e-2 (bf16 keeps 8 mantissa
bits, ~4e-3 relative per rounding; the fp32 masters keep the updates exact, so the error
does not grow with the steps; measured: loss 1.6e-4, parameters 2.8e-3 normwise, the
worst tensor, the embedding, 1.0e-2).

One per-tensor exception, the attention *key* biases (GPT-2's middle third of
``c_attn.bias``, BERT's ``key.bias``): adding a constant to every key shifts each query's
scores by a constant, which softmax ignores, so their true gradient is exactly zero and
both runs compute only rounding noise (~1e-9) that AdamW normalises into updates of up to
``lr`` per step, different noise in each run. They are left out of the normwise figure
and checked against that bound instead: ``|diff| <= 2 x lr x steps``.
"""

from __future__ import annotations

import functools

import pytest

from tests.harness import run_ranks
from tests.tolerance import check, composed, evaluation, per_tensor, trajectory

STEPS = 20
BF16_TOL = 2e-2
ADAMW = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
PARAMS_TOL = trajectory(ADAMW["lr"], STEPS)  # losses and the whole model, relative
NORM0_TOL = evaluation()  # the gradient norm from identical weights
NORM_TOL = composed(PARAMS_TOL, 2)  # the gradient norm from weights within PARAMS_TOL


def _seq(tp: int) -> int:
    return 9 if tp == 3 else 8  # sequence parallelism splits the sequence over tp


@functools.cache  # cases that share a reference run train it once
def _reference(kind: str, global_bs: int, clip: float, seq: int):
    import torch

    from tests.distributed.tp_models import batch, build, loss_of

    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), **{**ADAMW, "betas": tuple(ADAMW["betas"])})
    losses, norms = [], []
    for step in range(STEPS):
        loss = loss_of(model, kind, batch(kind, step, global_bs, seq))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or 1e30)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _engine_run(kind: str, stage: int, sp: bool, clip: float, tp: int, extra: str = "") -> dict:
    import torch.distributed as dist

    import meshtrain
    from tests.distributed.tp_models import batch, build, loss_of

    world = dist.get_world_size()
    dp = world // tp
    micro = 2
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": ADAMW},
        "mesh": {"tensor_parallel_size": tp},
        "tensor_parallel": {"sequence_parallel": sp},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    if extra == "ac":  # activation checkpointing of every block, recomputed in backward
        config["activation_checkpointing"] = {"enabled": True}
    if extra == "bf16":  # bf16 model, fp32 masters; compared with the fp32 reference
        config["bf16"] = {"enabled": True}
    engine, *_ = meshtrain.initialize(model=build(kind), config=config)
    d = engine.topology.dp_rank
    losses, norms = [], []
    for step in range(STEPS):
        full = batch(kind, step, micro * dp, _seq(tp))
        mine = {k: v[d * micro : (d + 1) * micro] for k, v in full.items()}
        loss = loss_of(engine, kind, mine)
        engine.backward(loss)
        engine.step()
        t = loss.detach().double().reshape(1)  # (a bf16 loss is upcast exactly)
        dist.all_reduce(t)
        losses.append(float(t) / world)  # tp ranks agree; the mean over dp is global
        norms.append(engine.get_global_grad_norm())
    report = engine.memory_report()
    state = engine.module_state_dict()
    ref_losses, ref_norms, ref_state = _reference(kind, micro * dp, clip, _seq(tp))
    shapes = all(state[k].shape == ref_state[k].shape for k in ref_state)
    keys = sorted(state) == sorted(ref_state)
    state, noise = _without_key_biases(state)
    ref_state, ref_noise = _without_key_biases(ref_state)
    num = sum(float((state[k] - ref_state[k]).pow(2).sum()) for k in ref_state)
    rel = {  # per tensor, against its own bound: small tensors' relative error is noisier
        k: float((state[k] - ref_state[k]).norm() / ref_state[k].norm().clamp_min(1e-12))
        for k in ref_state
    }
    numel = sum(v.numel() for v in ref_state.values())
    bound = {k: per_tensor(PARAMS_TOL, numel, v.numel()) for k, v in ref_state.items()}
    worst = max(rel, key=lambda k: rel[k] / bound[k])  # (key biases are left out above)
    den = sum(float(ref_state[k].pow(2).sum()) for k in ref_state)
    return {
        "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
        "params": (num / den) ** 0.5,
        "norm0": abs(norms[0] - ref_norms[0]) / ref_norms[0],
        "norm": max(abs(a - b) / b for a, b in zip(norms, ref_norms, strict=True)),
        "clipped": clip > 0 and min(ref_norms) > clip,
        "worst": (worst, f"{rel[worst]:.1e}"),
        "per_tensor": (rel[worst], bound[worst]),
        "keys": keys and shapes,
        "moved": max(float((state[k] - v).abs().max()) for k, v in _initial_kept(kind).items()),
        "key_bias_diff": max(
            (float((noise[k] - ref_noise[k]).abs().max()) for k in noise), default=0
        ),
        "memory": (report.tp, report.measured.params, report.ratio, _predicted_bytes(kind, tp)),
    }


def _predicted_bytes(kind: str, tp: int) -> int:
    from meshtrain.parallel.tensor.sizes import local_parameter_counts
    from tests.distributed.tp_models import build

    return 4 * local_parameter_counts(build(kind), tp)[0]  # fp32 parameters on one rank


def _without_key_biases(state: dict) -> tuple[dict, dict]:
    """(state without the attention key biases, those biases): see the module docstring."""
    kept, noise = dict(state), {}
    for k, v in state.items():
        if k.endswith("attn.c_attn.bias"):  # GPT-2: q | k | v
            q, key, val = v.chunk(3)
            kept[k], noise[k] = torch_cat(q, val), key
        elif k.endswith("attention.self.key.bias"):  # BERT
            noise[k] = kept.pop(k)
    return kept, noise


def torch_cat(*ts):
    import torch

    return torch.cat(ts)


def _initial_kept(kind: str):
    from tests.distributed.tp_models import build

    return _without_key_biases(build(kind).state_dict())[0]


def _runs(cases: list[tuple]) -> dict:
    return {case: _engine_run(*case) for case in cases}


TP2 = [  # (kind, zero stage, sequence parallel, clip, tp) at world 2
    ("decoder", 0, False, 0.0, 2),
    ("decoder", 0, True, 0.05, 2),
    ("llama", 0, True, 0.0, 2),
    ("llama", 0, False, 0.0, 2, "ac"),
    ("decoder", 0, True, 0.0, 2, "bf16"),
    ("gpt2", 0, False, 0.0, 2),
    ("gpt2", 0, True, 0.0, 2),
    ("llama_cls", 0, True, 0.0, 2),
    ("gpt2_cls", 0, True, 0.05, 2),
    ("bert", 0, False, 0.0, 2),
    ("bert", 0, True, 0.0, 2),
    ("bert_mlm", 0, False, 0.0, 2),
    ("bert_mlm", 0, True, 0.05, 2),
]
TP3 = [  # at world 3: grouped-query heads padded
    ("llama", 0, False, 0.0, 3),
    ("llama", 0, True, 0.05, 3),
]
WORLD4 = [  # tp 2 x dp 2, then tp 4
    ("decoder", 1, False, 0.05, 2),
    ("decoder", 3, True, 0.0, 2),
    ("decoder", 1, True, 0.0, 2, "ac"),
    ("llama", 1, False, 0.0, 2),
    ("gpt2", 3, False, 0.0, 2),
    ("llama_cls", 1, False, 0.0, 2),
    ("bert", 3, False, 0.0, 2),
    ("decoder", 0, False, 0.0, 4),
    ("decoder", 0, True, 0.05, 4),
    ("llama", 0, False, 0.0, 4),
    ("llama", 0, True, 0.0, 4),
    ("llama", 0, True, 0.0, 4, "bf16"),
]


@pytest.mark.parametrize(
    ("world", "cases"), [(2, TP2), (3, TP3), (4, WORLD4)], ids=["tp2", "tp3", "world4"]
)
def test_engine_matches_one_process(world, cases):
    results = run_ranks(_runs, world, cases, timeout=600)
    for case in cases:  # the figures, for the record (pytest -s)
        o = results[0][case]
        print(
            f"{case}: loss {o['loss']:.2e} params {o['params']:.2e} "
            f"norm@0 {o['norm0']:.2e} norm {o['norm']:.2e} worst tensor {o['worst']}"
        )
    for out in results:
        for case in cases:
            o = out[case]
            assert o["keys"], (case, o)
            if case[-1] == "bf16":  # 8-bit mantissa: ~4e-3 per rounding, BF16_TOL
                assert o["loss"] < BF16_TOL and o["params"] < BF16_TOL, (case, o)
                continue
            check(f"{case} loss", o["loss"], PARAMS_TOL)
            check(f"{case} params", o["params"], PARAMS_TOL)
            check(f"{case} worst tensor {o['worst'][0]}", *o["per_tensor"])
            check(f"{case} norm at step 0", o["norm0"], NORM0_TOL)
            check(f"{case} norm", o["norm"], NORM_TOL)
            assert o["moved"] > 1e-4, (case, o)  # training changed the weights
            assert o["key_bias_diff"] <= 2 * ADAMW["lr"] * STEPS, (case, o)
            tp, measured, ratio, predicted = o["memory"]
            assert tp == case[4] and ratio is not None and 0.95 < ratio < 1.05, (case, o)
            if case[1] == 0:  # stage 0 keeps this rank's whole shard of every parameter
                assert measured == predicted, (case, o)
            if case[3]:
                assert o["clipped"], (case, o)  # the clip was active

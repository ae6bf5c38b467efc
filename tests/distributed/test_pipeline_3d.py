"""Pipeline x data x tensor parallelism (3D) and ZeRO 2 inside pipeline stages, through
``meshtrain.initialize``, against the same engine on one process.

* 3D, pp 2 x dp 2 x tp 2 on 8 processes, one process group with four runs:
  - the reference decoder with its LM head tied to the vocab-sharded embedding (stage 0
    and the last stage hold the same tp shard; its gradient is summed per tp rank over
    the two stages), ZB-H1 (its weight-gradient step starts from what the input-gradient
    step saved, through the tensor-parallel layers), ZeRO 1;
  - the same decoder with sequence parallelism (activations travel between stages as
    each tp rank's sequence shard), interleaved 1F1B with 2 chunks per rank, ZeRO 2;
  - tiny transformers Llama (grouped-query attention, HF loss made vocab-parallel), 1F1B;
  - fp16 with a dynamic loss scale: an inf planted in one gradient on one rank of the
    last stage must skip that step, and halve the loss scale, on all 8 ranks.
* pp 2 x dp 2 with ZeRO 2 on 4 processes (tied decoder, 1F1B and ZB-H1).

Every run clips the gradient at 0.05, below the model's norm (~1) on every step, so
matching the one-process parameters proves the norm is global: over stages, over tp
(replicated norms counted once, shards summed) and over dp, the tied weight once.

Tolerances (fp32, ``tests/tolerance.py``): the same sums in another order (tp partial
sums, dp averages, the tied gradient added across stages), so losses within
``trajectory`` of SGD's per-element steps (``sgd_rate``) per step, global gradient norms
within ``gradient_from`` that bound, every parameter (tp shards gathered back to the full
tensor) within ``per_tensor`` of it after the last step.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.tolerance import check, gradient_from, per_tensor, sgd_rate, trajectory

STEPS = 4
ROWS = 2  # rows of every micro-batch in the global batch (one per dp replica at dp 2)
CLIP = 0.05


def _data(kind: str, step: int, part: slice = slice(None), m: int = 4) -> list:
    """The step's micro-batches (sequence lengths vary; even, for sequence parallelism);
    ``part`` selects a data-parallel replica's rows."""
    g = torch.Generator().manual_seed(900 + step)
    out = []
    for i in range(m):
        ids = torch.randint(0, 64, (ROWS, 4 + 2 * ((i + step) % 3)), generator=g)[part]
        out.append({"input_ids": ids, "labels": ids} if kind == "llama" else (ids, ids))
    return out


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        from tests.tiny_models import tiny_llama

        return tiny_llama(seed=3, attn_implementation="sdpa")
    from tests.tiny_models import tiny_decoder

    return tiny_decoder()


def _train(kind: str, pp: int, tp: int, dp: int, zero: int, schedule: str, v: int, **extra):
    """Inside a rank: STEPS steps of ``train_batch``; returns losses, norms and the full
    (tp-gathered) parameters this rank's stages hold."""
    import meshtrain
    from meshtrain.parallel.tensor.sharding import specs_by_param, unshard_tensor

    torch.set_num_threads(1)
    config = {
        "train_micro_batch_size_per_gpu": ROWS // dp,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
        "mesh": {"pipeline_parallel_size": pp, "tensor_parallel_size": tp},
        "zero_optimization": {"stage": zero},
        "pipeline": {"schedule": schedule, "virtual_stages": v},
        **extra,
    }
    model = _model(kind)
    engine, *_ = meshtrain.initialize(model=model, config=config)
    r = engine.topology.dp_rank
    part = slice(r * ROWS // dp, (r + 1) * ROWS // dp)
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(engine.train_batch(iter(_data(kind, step, part))).item())
        norms.append(engine.get_global_grad_norm())
    if engine.pipeline is None:
        module = engine.module
        params = dict(module.named_parameters())
    else:
        module = engine.module
        params = {n: p for s in module.stages.values() for n, p in s.names.items()}
    specs = specs_by_param(module)
    full = {}
    for name in sorted(params):  # the same order on every tp rank of a stage
        p = params[name].detach()
        spec = specs.get(id(params[name]))
        full[name] = (
            p.clone() if spec is None else unshard_tensor(p, spec, engine.topology.tp_group)
        )
    return losses, norms, full


def _references():
    return {kind: _train(kind, 1, 1, 1, 0, "1f1b", 1) for kind in ("decoder", "llama")}


def _fp16_trace():
    """pp 2 x dp 2 x tp 2 in fp16: an inf in one gradient on one rank of the last stage at
    step 1; returns (skipped, loss scale, parameters unchanged) per step."""
    import meshtrain

    torch.set_num_threads(1)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "steps_per_print": 1000,
        "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
        "mesh": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
    }
    engine, *_ = meshtrain.initialize(model=_model("decoder"), config=config)
    topo = engine.topology
    stage = next(iter(engine.module.stages.values()))
    target = next(
        p for n, p in stage.names.items() if "layers" in n and n.endswith("down_proj.weight")
    )
    plant = {"on": topo.pp_rank == 1 and topo.tp_rank == 1 and topo.dp_rank == 0}

    def hook(grad):
        return grad * float("inf") if plant["on"] and engine.global_steps == 1 else grad

    target.register_hook(hook)
    trace = []
    for step in range(3):
        before = target.detach().clone()
        part = slice(topo.dp_rank, topo.dp_rank + 1)
        engine.train_batch(iter(_data("decoder", step, part, m=2)))
        trace.append(
            (engine.last_step_skipped, engine.loss_scale, bool(torch.equal(before, target)))
        )
    return trace


def _three_d():
    runs = {
        "decoder": _train("decoder", 2, 2, 2, 1, "zb_h1", 1),
        "decoder_sp": _train(
            "decoder",
            2,
            2,
            2,
            2,
            "interleaved_1f1b",
            2,
            tensor_parallel={"sequence_parallel": True},
        ),
        "llama": _train("llama", 2, 2, 2, 1, "1f1b", 1),
    }
    return runs, _fp16_trace()


def _check(runs_per_rank, refs, key_to_kind):
    for key, kind in key_to_kind.items():
        ref_losses, ref_norms, ref_params = refs[kind]
        assert all(n > CLIP for n in ref_norms)  # clipping acts on every step
        names = set()
        numel = sum(t.numel() for t in ref_params.values())
        tol = trajectory(sgd_rate(0.05, numel, momentum=0.9), STEPS)
        for runs in runs_per_rank:
            losses, norms, params = runs[key]
            for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
                check(f"{key} loss {step}", abs(a - b) / abs(b), tol)
            for step, (a, b) in enumerate(zip(norms, ref_norms, strict=True)):
                check(f"{key} grad norm {step}", abs(a - b) / b, gradient_from(tol))
            for n, t in params.items():
                err = ((t - ref_params[n]).norm() / ref_params[n].norm()).item()
                check(f"{key} {n}", err, per_tensor(tol, numel, t.numel()))
            names |= set(params)
        assert names == set(ref_params), key


@pytest.fixture(scope="module")
def refs():
    return run_ranks(_references, 1)[0]


def test_pipeline_3d_matches_one_process(refs):
    per_rank = run_ranks(_three_d, 8, timeout=600)
    _check(
        [runs for runs, _ in per_rank],
        refs,
        {"decoder": "decoder", "decoder_sp": "decoder", "llama": "llama"},
    )
    # fp16: the step with the planted inf is skipped everywhere, the scale halves once
    traces = [trace for _, trace in per_rank]
    assert all(t == traces[0] for t in traces), traces
    assert [(s, scale) for s, scale, _ in traces[0]] == [(False, 256), (True, 128), (False, 128)]
    assert [same for _, _, same in traces[0]] == [False, True, False]


def _zero2():
    return {
        "1f1b": _train("decoder", 2, 1, 2, 2, "1f1b", 1),
        "zb_h1": _train("decoder", 2, 1, 2, 2, "zb_h1", 1),
    }


def test_pipeline_times_data_parallel_zero2(refs):
    """pp 2 x dp 2, ZeRO 2 over dp inside each stage (gradients reduce-scattered after
    every micro-batch's backward), tied decoder: 1F1B and ZB-H1 (whose weight-gradient
    step is where the reduction happens)."""
    per_rank = run_ranks(_zero2, 4)
    _check(per_rank, refs, {"1f1b": "decoder", "zb_h1": "decoder"})


def _whole_state_tp_pp():
    """tp 2 x pp 2: ``module_state_dict()`` on every rank, before and after one step."""
    import meshtrain

    torch.set_num_threads(1)
    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "steps_per_print": 1000,
        "mesh": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
    }
    engine, *_ = meshtrain.initialize(model=_model("decoder"), config=config)
    before = engine.module_state_dict()
    engine.train_batch(iter(_data("decoder", 0, m=2)))
    return before, engine.module_state_dict()


def _whole_state_reference():
    import meshtrain

    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "steps_per_print": 1000,
        "mesh": {"pipeline_parallel_size": 1},
    }
    model = _model("decoder")
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine, *_ = meshtrain.initialize(model=model, config=config)
    engine.train_batch(iter(_data("decoder", 0, m=2)))
    return initial, engine.module_state_dict()


def test_module_state_dict_under_tp_and_pp_is_the_whole_model():
    """Every rank of tp 2 x pp 2 gets the whole model: before training exactly the initial
    weights (tp shards gathered, the other stage's broadcast); after one SGD step within
    ``per_tensor`` of ``trajectory(sgd_rate(0.05), 1)`` of one process (tp partial sums in
    another order)."""
    initial, ref = run_ranks(_whole_state_reference, 1)[0]
    for before, after in run_ranks(_whole_state_tp_pp, 4):
        assert set(before) == set(initial) == set(after)
        for k, v in initial.items():
            assert torch.equal(before[k], v), k
        numel = sum(v.numel() for v in ref.values())
        tol = trajectory(sgd_rate(0.05, numel), 1)
        for k, v in ref.items():
            err = float((after[k] - v).norm() / max(v.norm(), 1e-12))
            check(f"one step {k}", err, per_tensor(tol, numel, v.numel()))

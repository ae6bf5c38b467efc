"""``meshtrain plan``'s search, memory and time models: pure arithmetic on meta-device
models (no processes). The measured tables are in test_plan_measured.py."""

from __future__ import annotations

import json

import pytest
import torch

from meshtrain.errors import ConfigError
from meshtrain.estimate.model_states import model_states_bytes
from meshtrain.plan.hardware import Hardware
from meshtrain.plan.layout import Layout
from meshtrain.plan.model_facts import ModelFacts, load_model
from meshtrain.plan.planner import Planner

SMALL = "decoder:dim=256,n_layers=4,n_heads=4,ffn_dim=688,vocab_size=4224,max_seq_len=256"
LLAMA_8B = (
    "decoder:dim=4096,n_layers=32,n_heads=32,ffn_dim=14336,vocab_size=128256,max_seq_len=8192"
)
GiB = 1 << 30


def _planner(spec=SMALL, gpus=4, seq=256, batch=8, limit=80 * GiB, gpu="H100", **kw):
    facts = ModelFacts.of(load_model(spec))
    return Planner(facts, Hardware.named(gpu), gpus=gpus, seq=seq, global_batch=batch,
                   limit=limit, **kw)  # fmt: skip


def _moe_facts():
    from meshtrain.models import Decoder, DecoderConfig

    with torch.device("meta"):
        model = Decoder(DecoderConfig(vocab_size=512, dim=128, n_layers=4, n_heads=4,
                                      ffn_dim=256, max_seq_len=256,
                                      moe={"n_experts": 4, "top_k": 2}))  # fmt: skip
    return ModelFacts.of(model)


def test_every_dimension_is_searched_and_every_layout_loads():
    """The search turns every knob, and every layout it keeps is a config that
    ``load_config`` and the engine's batch resolution accept (what initialize does)."""
    from meshtrain.config import load_config

    p = _planner()
    layouts = list(p.layouts())
    seen = {
        "stage3": any(x.stage == 3 for x in layouts),
        "offload": any(x.offload_param for x in layouts),
        "sp": any(x.sequence_parallel for x in layouts),
        "zb_h1": any(x.schedule == "zb_h1" for x in layouts),
        "interleaved": any(x.virtual_stages == 2 for x in layouts),
        "a2a": any(x.cp_method == "all_to_all" for x in layouts),
        "ac": any(x.checkpointing for x in layouts),
        "mb": len({x.micro_batch for x in layouts}) > 1,
    }
    assert all(seen.values()), seen
    for x in layouts[::37]:
        cfg = load_config(x.config("bf16"), world_size=x.world)
        cfg.resolve_batch_sizes(x.dp)
    # the engine refuses ZeRO-3 under a pipeline: never proposed
    assert not any(x.stage == 3 and x.pp > 1 for x in layouts)


def test_refusals_come_from_the_engine_checks():
    """ep, cp and (since the engine builds it) cp x pp layouts are searched for a MoE
    model, by the engine's own checks; the one layout the engine runs and the planner
    does not model is refused as the planner's own."""
    facts = _moe_facts()
    p = Planner(facts, Hardware.named("H100"), gpus=4, seq=256, global_batch=8, limit=80 * GiB)
    layouts = list(p.layouts())
    assert any(x.ep == 4 for x in layouts) and any(x.cp > 1 for x in layouts)
    # MoE under cp x pp: built by the engine (its stages carry each cp chunk's router
    # sums), so the planner proposes it
    assert any(x.cp > 1 and x.pp > 1 for x in layouts)
    assert p.check.refusal(Layout(dp=1, cp=2, pp=2, grad_accum=2)) is None
    # ZeRO-3 under a pipeline: the engine runs it, the planner does not model it (its own
    # refusal, by name), and never enumerates it
    z3pp = Layout(dp=2, pp=2, stage=3, grad_accum=2)
    assert p.check.refusal(z3pp) is None
    why = p.refusal(z3pp)
    assert why and why.startswith("zero_optimization.stage 3") and "not planned" in why
    assert not any(x.pp > 1 and x.stage == 3 for x in layouts)


def test_model_states_are_the_estimate_formulas():
    """The memory model's states are ``model_states_bytes`` exactly (dp x cp replicas,
    tp through the plan); under ZeRO-3 plus the persistent parameters kept whole."""
    from meshtrain.plan.memory import zero3_units

    p = _planner(precision="bf16")
    for x in (Layout(dp=4, stage=2), Layout(dp=2, tp=2, stage=1), Layout(dp=2, cp=2, stage=3)):
        got = p.predict(x).memory.states
        want = model_states_bytes(p.facts.model, dp=x.dp * x.cp, stage=x.stage,
                                  precision="bf16", optimizer="AdamW", tp=x.tp)  # fmt: skip
        extra = 0
        if x.stage == 3:
            whole, _, experts = zero3_units(p.facts)
            assert experts == 0  # no experts in the decoder
            extra = 2 * (whole - -(-whole // (x.dp * x.cp)))
            assert whole > 0  # the 256 x 256 projections are under the 100k threshold
        assert got.params == want.params + extra
        assert (got.grads, got.optimizer) == (want.grads, want.optimizer)


def test_activations_without_tp_are_the_estimate_formula():
    """At tp 1, pp 1 the activation peak is ``peak_activation_bytes`` (measured within
    0.1% on the Decoder by tests/test_estimate_activations.py)."""
    from meshtrain.estimate.activations import DecoderDims, peak_activation_bytes

    p = _planner(precision="fp32")
    dims = DecoderDims.of(p.facts.model)
    for x in (Layout(dp=4, micro_batch=2), Layout(dp=2, cp=2, cp_method="all_to_all")):
        got = p.predict(x).memory.activations
        want = peak_activation_bytes(dims, seq_len=256, cp=x.cp, batch=x.micro_batch, width=4,
                                     method="all_to_all", position_ids=x.cp > 1)  # fmt: skip
        assert got == want


def test_bubble_is_the_schedules_idle_fraction():
    """A pipeline's compute is stretched by the idle fraction of its action lists."""
    from meshtrain.parallel.pipeline.validate import idle_fraction

    p = _planner()
    x = Layout(dp=1, pp=4, micro_batch=1, grad_accum=8)
    t = p.predict(x).time
    f = float(idle_fraction(p.check.schedule("1f1b", 4, 8, 1)))
    assert t.bubble == pytest.approx(t.compute * f / (1 - f))
    assert p.predict(x.but(schedule="zb_h1")).time.bubble < t.bubble


def test_published_llama3_8b_within_30_percent():
    """The published torchtitan Llama-3-8B run (8 H100, FSDP, AC, seq 8192): 6,667
    tokens/s per GPU. The planner's prediction of that layout is within 30%, and its own
    winner is predicted at least as fast."""
    p = _planner(LLAMA_8B, gpus=8, seq=8192, batch=8, limit=Hardware.named("H100").memory_bytes)
    x = Layout(dp=8, stage=3, micro_batch=1, grad_accum=1, checkpointing=True)
    assert p.refusal(x) is None
    pred = p.predict(x)
    assert pred.fits
    assert abs(pred.tokens_per_s / 6667 - 1) < 0.30
    best = next(q for q in p.ranked() if q.fits)
    assert best.tokens_per_s >= pred.tokens_per_s


def test_winner_config_is_accepted_by_train_and_initialize_loaders(tmp_path):
    """The winner is written as a config that ``meshtrain train --config`` merges and
    validates (``build_job_dict``, ``check_engine_config``) and ``load_config`` takes."""
    from meshtrain.config import load_config
    from meshtrain.jobs.train.job_config import build_job_dict, check_engine_config

    p = _planner(precision="fp32", gpu="H100", gpus=2)
    win = next(q for q in p.ranked() if q.fits).layout
    path = tmp_path / "winner.json"
    path.write_text(json.dumps(win.config("fp32")))
    load_config(str(path), world_size=win.world)
    data = build_job_dict(str(path))
    check_engine_config(data, win.world)


def test_explain_advises_changes_that_fit():
    """A layout over the limit gets single changes that fit, cheapest first, and each is
    accepted by the checks."""
    from meshtrain.plan.explain import advice, single_changes

    p = _planner(LLAMA_8B, gpus=8, seq=8192, batch=8, limit=70 * GiB)
    cur = p.predict(Layout(dp=8, stage=1, micro_batch=1))
    assert not cur.fits
    changes = single_changes(p, cur)
    fit = [c for c in changes if c[1].fits]
    assert fit and all(p.refusal(c[1].layout) is None for c in fit)
    times = [c[1].time.total for c in fit]
    assert times == sorted(times)
    assert "cheapest single changes" in advice(p, cur)


def test_bad_inputs_name_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="known: H100, H200, A100, L40S, B200, cpu"):
        Hardware.named("X100")
    with pytest.raises(ConfigError, match="no such file"):
        load_model(str(tmp_path / "missing.json"))
    (tmp_path / "train.json").write_text('{"train_batch_size": 8}')
    with pytest.raises(ConfigError, match="not a model config.*--config"):
        load_model(str(tmp_path / "train.json"))
    (tmp_path / "x.toml").write_text("[a]\nb = 1\n")
    with pytest.raises(ConfigError, match="not a JSON model config"):
        load_model(str(tmp_path / "x.toml"))


def test_nothing_fits_says_what_to_relax():
    from meshtrain.plan.report import nothing_fits

    p = _planner(LLAMA_8B, gpus=1, seq=8192, batch=1, limit=8 * GiB)
    preds = p.ranked()
    assert not any(q.fits for q in preds)
    text = nothing_fits(preds, p.limit, 1)
    assert "--max-memory: to at least" in text and "--gpus" in text


def test_calibration_fit_recovers_constants_and_round_trips(tmp_path, monkeypatch):
    """Synthetic runs made with known constants are fitted back; the store reloads."""
    from meshtrain.plan.calibration import ENV, Calibration

    eff, bw, slot, one = 0.6, 2e9, 0.02, 0.05
    rows = []
    for compute, wire, slots in ((0.1, 0, 1), (0.4, 0, 1), (0.1, 0, 4), (0.2, 4e8, 1),
                                 (0.1, 2e8, 2), (0.3, 1e9, 3)):  # fmt: skip
        t = compute / eff + wire / bw + slot * slots + one
        rows.append({"compute": compute, "wire": wire, "slots": slots, "measured": t})
    cal = Calibration.fit(rows, 1e11)
    assert cal.efficiency == pytest.approx(eff, rel=1e-6)
    assert cal.bw_intra == pytest.approx(bw, rel=1e-6)
    assert cal.micro_step_s == pytest.approx(slot, rel=1e-6)
    monkeypatch.setenv(ENV, str(tmp_path / "cal.json"))
    cal.save()
    back = Calibration.load()
    assert back.efficiency == pytest.approx(eff) and back.machine == Calibration.machine_key()
    hw = back.apply(Hardware.named("H100"))
    assert hw.efficiency == pytest.approx(eff)


def test_gpu_calibration_keeps_what_one_gpu_cannot_measure(tmp_path, monkeypatch):
    """A calibration fitted on one GPU replaces efficiency, fixed costs, the optimizer's
    bandwidth and the framework's device memory; the links keep the data sheet's (one GPU
    has no link to fit, one node no inter-node link). It is stored under that device, apart
    from the CPU ranks' calibration of the same machine."""
    from meshtrain.plan.calibration import ENV, Calibration

    rows = [{"compute": c, "wire": 0, "slots": k, "measured": c / 0.4 + 0.003 * k + 0.01}
            for c, k in ((0.1, 1), (0.4, 1), (0.1, 4), (0.2, 2))]  # fmt: skip
    cal = Calibration.fit(rows, 989.4e12, device="H100", overhead_bytes=3 << 30,
                          links_fitted=False)  # fmt: skip
    sheet = Hardware.named("H100")
    hw = cal.apply(sheet)
    assert hw.efficiency == pytest.approx(0.4, rel=1e-6)
    assert hw.micro_step_s == pytest.approx(0.003, rel=1e-6)
    assert (hw.bw_intra, hw.bw_inter) == (sheet.bw_intra, sheet.bw_inter)
    assert hw.overhead_bytes == 3 << 30 and hw.memory_bytes == sheet.memory_bytes
    monkeypatch.setenv(ENV, str(tmp_path / "cal.json"))
    cal.save()
    assert Calibration.load(device="H100").efficiency == pytest.approx(0.4, rel=1e-6)
    assert Calibration.load() is None  # the CPU ranks' entry is another key


def test_gpu_calibration_runs_and_refusal():
    """The runs a GPU calibration measures: one GPU, the single-rank layouts of both
    models; two or more, the two-rank layouts too (ranks never share a GPU). No GPU: one
    line naming the flag and what to do."""
    from meshtrain.errors import ConfigError
    from meshtrain.plan.calibrate import GPU_MODEL, gpu_runs

    one, two = gpu_runs(1), gpu_runs(2)
    assert all(x.world == 1 for _, x in one) and len(one) == 5
    assert {x.world for _, x in two} == {1, 2} and len(two) == 10
    assert all(cfg is GPU_MODEL for cfg, x in two if x.world == 2)
    with pytest.raises(ConfigError, match=r"^--calibrate --gpu: this machine has no CUDA"):
        gpu_runs(0)


def test_spearman():
    from meshtrain.plan.proof import spearman

    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)

"""``fp8.enabled``: torchao float8 linear layers, and every refusal by name.

On this CPU machine float8 runs only in torchao's emulation (``fp8.emulate``); the real
float8 matmuls were measured on an H200 by ``benchmarks/gpu_check.py`` (docs/performance.md).
"""

from __future__ import annotations

import sys

import pytest
import torch

from meshtrain.config.sections import FP8Config
from meshtrain.errors import ConfigError
from meshtrain.models import Decoder, DecoderConfig
from meshtrain.parallel.float8 import apply_float8
from tests.harness import run_ranks

SPEC = dict(vocab_size=128, dim=64, n_layers=2, n_heads=4, ffn_dim=176, max_seq_len=32)


def _decoder() -> Decoder:
    return Decoder(DecoderConfig(**SPEC, seed=3))


def test_missing_torchao_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails
    with pytest.raises(ConfigError, match=r"fp8\.enabled.*torchao.*pip install torchao"):
        apply_float8(_decoder(), FP8Config(enabled=True), torch.device("cpu"))


def test_cpu_without_emulation_is_refused():
    pytest.importorskip("torchao.float8")
    with pytest.raises(ConfigError, match=r"fp8\.enabled.*CUDA GPU.*device is cpu.*fp8\.emulate"):
        apply_float8(_decoder(), FP8Config(enabled=True), torch.device("cpu"))


def test_tensor_parallel_is_refused():
    with pytest.raises(ConfigError, match=r"fp8\.enabled.*tensor parallelism \(tp=2\)"):
        apply_float8(_decoder(), FP8Config(enabled=True), torch.device("cpu"), tp_size=2)


def test_nothing_convertible_is_refused():
    pytest.importorskip("torchao.float8")
    model = torch.nn.Sequential(torch.nn.Linear(10, 6))  # not multiples of 16
    with pytest.raises(ConfigError, match="no linear layer"):
        apply_float8(model, FP8Config(enabled=True, emulate=True), torch.device("cpu"))


def test_unknown_fp8_key_is_refused():
    from meshtrain.config import load_config

    with pytest.raises(ConfigError, match=r"fp8\.recipe"):
        load_config({"fp8": {"enabled": True, "recipe": "rowwise"}})


def test_emulated_conversion_keeps_parameters_and_is_close():
    """Every block linear converted, lm_head kept; parameters unchanged (same names, same
    values); loss within 2% of the bf16 model: e4m3 keeps 3 mantissa bits (~6% per
    element), averaged over the matmul's sums and a near-uniform initial softmax."""
    pytest.importorskip("torchao.float8")
    ref, model = _decoder().to(torch.bfloat16), _decoder().to(torch.bfloat16)
    names = apply_float8(model, FP8Config(enabled=True, emulate=True), torch.device("cpu"))
    assert len(names) == 7 * SPEC["n_layers"] and "lm_head" not in names
    assert type(model.lm_head) is torch.nn.Linear
    assert ref.state_dict().keys() == model.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    x = torch.randint(0, SPEC["vocab_size"], (2, SPEC["max_seq_len"]))
    a, b = ref(x, x), model(x, x)
    b.backward()
    a, b = float(a.detach()), float(b.detach())
    assert abs(a - b) / a < 2e-2
    assert model.layers[0].mlp.up_proj.weight.grad is not None


def test_skip_modules_chooses_what_stays():
    pytest.importorskip("torchao.float8")
    model = _decoder()
    fp8 = FP8Config(enabled=True, emulate=True, skip_modules=["mlp"])
    names = apply_float8(model, fp8, torch.device("cpu"))
    assert "lm_head" in names and not any("mlp" in n for n in names)
    assert type(model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert type(model.layers[0].attn.q_proj).__name__ == "Float8Linear"


def _engine_run(fp8: bool) -> dict:
    import meshtrain

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "steps_per_print": 10**9,
        "fp8": {"enabled": fp8, "emulate": True},
    }
    model = _decoder()
    engine, *_ = meshtrain.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, SPEC["vocab_size"], (2, SPEC["max_seq_len"]), generator=g)
    losses = []
    for _ in range(3):
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    kinds = sorted({type(m).__name__ for m in engine.module.modules()})
    return {"losses": losses, "kinds": kinds, "ratio": engine.memory_report().ratio}


def _both() -> dict:
    return {"bf16": _engine_run(False), "fp8": _engine_run(True)}


def test_engine_trains_with_emulated_fp8_like_bf16():
    """Through ``meshtrain.initialize`` at world 1: fp8 layers in the engine's module,
    model-state bytes as without fp8 (the same ratio to the formula), and three AdamW
    steps on one batch within 3% of bf16's losses (the emulation's rounding, above,
    compounded over three updates at lr 1e-3)."""
    pytest.importorskip("torchao.float8")
    out = run_ranks(_both, 1)[0]
    assert "Float8Linear" in out["fp8"]["kinds"] and "Float8Linear" not in out["bf16"]["kinds"]
    assert out["fp8"]["ratio"] == out["bf16"]["ratio"]
    for a, b in zip(out["fp8"]["losses"], out["bf16"]["losses"], strict=True):
        assert abs(a - b) / b < 3e-2
    assert out["fp8"]["losses"][-1] < out["fp8"]["losses"][0]

"""The model-state memory estimator against the ZeRO paper (Rajbhandari et al. 2020, Fig. 1).

Every number is exact bytes: 7.5e9 divides by 64, so no rounding is involved except the
paper's own 3-significant-digit display, which the table reproduces.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from meshtrain.cli import main
from meshtrain.errors import ConfigError
from meshtrain.estimate.cli import parse_count
from meshtrain.estimate.model_states import (
    ModelStates,
    count_params,
    estimate_table,
    model_states_bytes,
    optimizer_state_bytes,
)
from meshtrain.models import Decoder, DecoderConfig
from tests.tiny_models import tiny_llama_config

PSI = 7_500_000_000


def test_paper_table_exact_bytes():
    s0 = model_states_bytes(7.5e9, dp=64, stage=0)
    assert s0 == ModelStates(params=2 * PSI, grads=2 * PSI, optimizer=12 * PSI, host=0)
    assert s0.total == 120 * 10**9
    totals = [model_states_bytes(7.5e9, dp=64, stage=s).total for s in (1, 2, 3)]
    assert totals == [
        PSI * 4 + PSI * 12 // 64,  # 31.40625e9
        PSI * 2 + PSI * 14 // 64,  # 16.640625e9
        PSI * 16 // 64,  # 1.875e9
    ]
    assert [round(t / 1e9, 1) for t in totals[:2]] == [31.4, 16.6]
    assert round(totals[2] / 1e9, 2) == 1.88
    # bf16 holds the same bytes as fp16; AdamW the same states as Adam
    assert model_states_bytes(PSI, dp=64, stage=2, precision="bf16", optimizer="adamw") == (
        model_states_bytes(PSI, dp=64, stage=2)
    )


def test_stage_breakdown_and_dp1_is_ddp():
    s2 = model_states_bytes(PSI, dp=64, stage=2)
    assert (s2.params, s2.grads, s2.optimizer) == (2 * PSI, 2 * PSI // 64, 12 * PSI // 64)
    s3 = model_states_bytes(PSI, dp=64, stage=3)
    assert (s3.params, s3.grads, s3.optimizer) == (2 * PSI // 64, 2 * PSI // 64, 12 * PSI // 64)
    for stage in (1, 2, 3):  # nothing to partition over one rank
        assert model_states_bytes(PSI, dp=1, stage=stage).total == 16 * PSI


def test_partition_rounds_up_to_the_largest_rank():
    s = model_states_bytes(10, dp=4, stage=3)  # 10 elements over 4 ranks: 3 on rank 0
    assert (s.params, s.grads, s.optimizer) == (2 * 3, 2 * 3, 12 * 3)


def test_fp32_and_other_optimizers():
    s = model_states_bytes(PSI, stage=0, precision="fp32")
    assert (s.params, s.grads, s.optimizer) == (4 * PSI, 4 * PSI, 8 * PSI)
    assert model_states_bytes(PSI, dp=64, stage=2, precision="FP32").total == (
        4 * PSI + (4 + 8) * PSI // 64
    )
    assert [optimizer_state_bytes(o) for o in ("Adam", "SGD", "sgd-momentum", "Adagrad")] == [
        12,
        4,
        8,
        8,
    ]
    assert [optimizer_state_bytes(o, "fp32") for o in ("adamw", "sgd", "momentum")] == [8, 0, 4]
    assert optimizer_state_bytes(6) == 6  # K given directly
    assert model_states_bytes(100, optimizer=6).optimizer == 600


def test_offload():
    s = model_states_bytes(PSI, dp=64, stage=2, offload_optimizer=True)
    assert (s.params, s.grads, s.optimizer, s.host) == (2 * PSI, 2 * PSI // 64, 0, 12 * PSI // 64)
    assert s.total == 2 * PSI + 2 * PSI // 64
    s = model_states_bytes(PSI, dp=64, stage=3, offload_optimizer=True, offload_param=True)
    assert (s.params, s.grads, s.optimizer, s.host) == (0, 2 * PSI // 64, 0, 14 * PSI // 64)
    s = model_states_bytes(PSI, dp=64, stage=3, offload_param=True)
    assert (s.params, s.optimizer, s.host) == (0, 12 * PSI // 64, 2 * PSI // 64)


def test_tp_pp_divide_first():
    assert model_states_bytes(PSI, dp=8, stage=1, tp=2, pp=4) == model_states_bytes(
        PSI // 8, dp=8, stage=1
    )
    s = model_states_bytes(PSI, dp=8, stage=3, tp=8)
    assert s.total == 16 * PSI // 64


def _small(tie: bool) -> Decoder:
    return Decoder(
        DecoderConfig(
            vocab_size=64,
            dim=16,
            n_layers=2,
            n_heads=2,
            ffn_dim=32,
            max_seq_len=8,
            tie_embeddings=tie,
        )
    )


def test_count_params_ties_and_frozen():
    untied, tied = _small(False), _small(True)
    per_layer = 2 * 16 + 4 * 16 * 16 + 3 * 16 * 32  # two norms, q/k/v/o, gate/up/down
    embed = 64 * 16
    assert count_params(untied) == 2 * embed + 2 * per_layer + 16
    assert count_params(tied) == count_params(untied) - embed  # the shared matrix once
    assert count_params(tied) == sum(p.numel() for p in tied.parameters())
    assert model_states_bytes(tied, dp=2, stage=3).total == 16 * -(-count_params(tied) // 2)
    # frozen parameters: 16-bit weights only, no grads or optimizer states
    tied.embed.weight.requires_grad_(False)
    n = count_params(tied)
    s = model_states_bytes(tied, stage=0)
    assert (s.params, s.grads, s.optimizer) == (2 * (n + embed), 2 * n, 12 * n)
    assert model_states_bytes(n, frozen_params=embed) == s


def test_meta_model_and_table():
    with torch.device("meta"):
        m = _small(False)
    assert count_params(m) == count_params(_small(False))
    table = estimate_table(m, dp=2)
    assert "dp=2" in table and f"({count_params(m):,})" in table


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = main(["estimate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _rows(out: str) -> list[str]:
    """The table's stage rows (the lines starting with a stage number)."""
    return [line for line in out.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"], ["3"])]


def test_cli_paper_case(capsys):
    rc, out, _ = _cli(["--params", "7.5e9", "--dp", "64"], capsys)
    assert rc == 0
    rows = [line.split() for line in _rows(out)]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert [" ".join(r[-2:]) for r in rows] == ["120 GB", "31.4 GB", "16.6 GB", "1.88 GB"]
    assert "GB = 1e9 bytes" in out


def test_cli_offload_and_model(capsys):
    rc, out, _ = _cli(
        ["--params", "7.5B", "--dp", "64", "--offload-optimizer", "--offload-param"], capsys
    )
    assert rc == 0
    rows = {line.split()[0]: line for line in _rows(out)}
    assert rows["0"].split()[-3:] == ["-", "0", "GB"]  # stage 0 cannot offload
    assert "optimizer+params" in rows["3"] and rows["3"].endswith("1.64 GB")
    rc, out, _ = _cli(
        [
            "--model",
            "decoder:dim=16,n_layers=2,n_heads=2,ffn_dim=32,vocab_size=64,tie_embeddings=true",
            "--tp",
            "2",
        ],
        capsys,
    )
    assert rc == 0 and f"({count_params(_small(True)):,})" in out and "tp=2" in out


def test_cli_hf_config(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = tiny_llama_config(vocab_size=128)
    cfg.save_pretrained(tmp_path)
    expected = count_params(transformers.LlamaForCausalLM(cfg))  # includes the LM head
    for target in (tmp_path, tmp_path / "config.json"):
        rc, out, err = _cli(["--model", f"hf:{target}"], capsys)
        assert rc == 0, err
        assert f"({expected:,})" in out
    # a config that records no architectures (written by hand, or LlamaConfig().save):
    # still the causal LM with its untied head, and it splits into pipeline stages
    cfg.architectures = None
    cfg.save_pretrained(tmp_path / "bare")
    rc, out, err = _cli(["--model", f"hf:{tmp_path / 'bare'}", "--pp", "2"], capsys)
    assert rc == 0, err
    assert f"({expected:,})" in out


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"dp": 0}, ["dp", ">= 1", "0"]),
        ({"tp": -1}, ["tp", ">= 1"]),
        ({"stage": 4}, ["stage", "0, 1, 2, 3", "4"]),
        ({"stage": 2, "offload_param": True}, ["offload_param", "stage 3", "stage is 2"]),
        ({"stage": 0, "offload_optimizer": True}, ["offload_optimizer", "1, 2 or 3"]),
        ({"optimizer": "Lamb"}, ["optimizer", "'Lamb'", "Adam, AdamW, SGD"]),
        ({"precision": "fp8"}, ["precision", "'fp8'", "fp16, bf16, fp32"]),
    ],
)
def test_errors_name_argument_and_allowed_values(kwargs, words):
    with pytest.raises(ConfigError) as info:
        model_states_bytes(PSI, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_bad_counts_and_cli_errors(capsys):
    for bad in (0, -5, float("nan"), "7.5e9"):
        with pytest.raises(ConfigError, match="num_params"):
            model_states_bytes(bad)
    assert [parse_count(s) for s in ("7.5e9", "7_500_000_000", "7.5B", "350m", "1.5T")] == [
        PSI,
        PSI,
        PSI,
        350 * 10**6,
        1_500 * 10**9,
    ]
    with pytest.raises(ConfigError, match="--params"):
        parse_count("seven")
    rc, out, err = _cli(["--params", "1e9", "--optimizer", "lamb"], capsys)
    assert rc == 2 and out == "" and "meshtrain estimate: error: optimizer" in err
    rc, _, err = _cli(["--model", "decoder:dim=15"], capsys)
    assert rc == 2 and "--model decoder" in err
    rc, _, err = _cli(["--model", "decoder:width=8"], capsys)
    assert rc == 2 and "dim, n_layers" in err
    rc, _, err = _cli(["--model", "gpt2"], capsys)
    assert rc == 2 and "decoder:KEY=VALUE" in err and "hf:PATH" in err


def test_import_is_light():
    code = "import sys, meshtrain.estimate.model_states; print(json.dumps('transformers' in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out) is False

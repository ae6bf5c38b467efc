"""``meshtrain estimate`` with pipeline parallelism: each pp rank's parameters and model
states (the model cut as the engine cuts it), the peak number of micro-batches alive for
each schedule, and the activation formula. Exact integers throughout (no tolerance):
the counts are sums of tensor sizes and the peaks come from the action lists."""

from __future__ import annotations

import pytest
import torch

from meshtrain.cli import main
from meshtrain.estimate.model_states import count_params, model_states_bytes
from meshtrain.estimate.pipeline import (
    TransformerDims,
    block_activation_bytes,
    peak_activations,
    pipeline_memory,
)
from meshtrain.models import Decoder, DecoderConfig
from meshtrain.parallel.pipeline.schedules import build_schedule
from meshtrain.parallel.pipeline.validate import peak_alive


def _meta_decoder(tie: bool = False) -> Decoder:
    cfg = DecoderConfig(
        vocab_size=64, dim=32, n_layers=4, n_heads=2, ffn_dim=48, max_seq_len=16, tie_embeddings=tie
    )
    with torch.device("meta"):
        return Decoder(cfg)


@pytest.mark.parametrize("tie", [False, True])
def test_stage_parameters_and_model_states(tie):
    model = _meta_decoder(tie)
    rows = pipeline_memory(model, pp=2, m=4, dp=2, stage=1, precision="bf16", optimizer="AdamW")
    # a tied embedding / head is held (and counted) on the first and the last rank
    assert sum(r.trainable for r in rows) == count_params(model) + (64 * 32 if tie else 0)
    assert [r.stages for r in rows] == [(0,), (1,)] and [r.blocks for r in rows] == [2, 2]
    for r in rows:
        want = model_states_bytes(r.trainable, dp=2, stage=1, precision="bf16", optimizer="AdamW")
        assert r.states == want


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [1, 3, 4, 8])
def test_peak_micro_batches_per_schedule(p, m):
    def peaks(name: str, v: int = 1) -> list[int]:
        zero = {k: 0 for k in range(p * v)}
        return [
            peak_activations(name, p, m, v, r, {k: 0 for k in zero if k % p == r})[0]
            for r in range(p)
        ]

    assert peaks("gpipe") == [m] * p
    assert peaks("1f1b") == [min(m, p - r) for r in range(p)]
    assert peaks("zb_h1") == [min(m, p)] * p
    inter = peaks("interleaved_1f1b", 2)
    assert inter == [
        peak_alive(build_schedule("interleaved_1f1b", p, m, 2), "rank")[r] for r in range(p)
    ]
    if m % p == 0:  # the schedules' docstring bound, k = p, capped by the v m chunks
        assert inter == [min(2 * m, (2 - 1) * p + 2 * (p - 1 - r) + 1) for r in range(p)]


def test_activation_bytes_formula():
    dims = TransformerDims(hidden=4096, heads=32, vocab=32000, max_seq_len=2048)
    b, s, h, a = 2, 2048, 4096, 32
    # 16-bit: Korthikanti et al.'s s b h (34 + 5 a s / h)
    assert block_activation_bytes(dims, b, s, 2) == 34 * s * b * h + 5 * a * s * s * b
    assert block_activation_bytes(dims, b, s, 2, checkpointed=True) == 2 * s * b * h
    model = _meta_decoder()
    dims = TransformerDims.of(model)
    assert dims == TransformerDims(32, 2, 64, 16)
    block = block_activation_bytes(dims, 4, 16, 2)
    head = 4 * 16 * 64 * (2 + 4)
    rows = pipeline_memory(model, pp=4, m=8, micro_batch_size=4)  # 1F1B, one block a stage
    assert [r.activations for r in rows] == [(4 - r) * block for r in range(3)] + [block + head]
    ckpt = pipeline_memory(model, pp=4, m=8, micro_batch_size=4, checkpointing=True)
    small = block_activation_bytes(dims, 4, 16, 2, checkpointed=True)
    assert ckpt[0].activations == 4 * small + block  # + one block recomputed at a time


def test_cli_pipeline_table(capsys):
    spec = "decoder:dim=32,n_layers=4,n_heads=2,ffn_dim=48,vocab_size=64,max_seq_len=16"
    rc = main(["estimate", "--model", spec, "--pp", "2", "--micro-batches", "4", "--dp", "2"])
    out, _ = capsys.readouterr()
    assert rc == 0 and "Per pipeline rank: schedule 1f1b, m=4" in out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("pp rank"))
    rows = [line.split() for line in lines[head + 1 : head + 3]]
    rows_api = pipeline_memory(_meta_decoder(), pp=2, m=4, dp=2)
    assert [r[:4] for r in rows] == [
        [str(x.rank), str(x.stages[0]), str(x.blocks), f"{x.trainable:,}"] for x in rows_api
    ]
    assert [r[6] for r in rows] == ["2", "1"]  # peak micro-batches: p - s
    rc = main(["estimate", "--params", "1B", "--pp", "2"])
    out, _ = capsys.readouterr()
    assert rc == 0 and "give --model" in out


def test_bad_pipeline_arguments_name_the_field():
    from meshtrain.errors import ConfigError

    model = _meta_decoder()
    with pytest.raises(ConfigError, match="micro_batch_size: must be an integer >= 1"):
        pipeline_memory(model, pp=2, m=4, micro_batch_size=0)
    with pytest.raises(ConfigError, match="cannot cut 4 layers into 8 pipeline stages"):
        pipeline_memory(model, pp=4, m=4, schedule="interleaved_1f1b", virtual_stages=2)

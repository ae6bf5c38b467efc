"""The ``tensor_parallel`` config section and plans, without processes."""

from __future__ import annotations

import pytest

from meshtrain.config import Config
from meshtrain.errors import ConfigError
from meshtrain.parallel.tensor import PLANS, TPPlan, plan_for
from meshtrain.parallel.tensor.sharding import ShardSpec, shard_tensor, unshard_pieces


def test_autotp_size_is_mesh_tensor_parallel_size():
    cfg = Config.from_dict({"tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}})
    assert cfg.mesh.tensor_parallel_size == 2 and cfg.tensor_parallel.sequence_parallel
    same = Config.from_dict(
        {"mesh": {"tensor_parallel_size": 2}, "tensor_parallel": {"autotp_size": 2}}
    )
    assert same.mesh.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match="autotp_size 2 != mesh.tensor_parallel_size 4"):
        Config.from_dict(
            {"mesh": {"tensor_parallel_size": 4}, "tensor_parallel": {"autotp_size": 2}}
        )
    assert Config.from_dict({}).mesh.tensor_parallel_size == 1


def test_plan_from_config_dict():
    plan = TPPlan.from_dict(
        {"rows": [["blocks.*.up", "column"], ["blocks.*.down", "row"]], "name": "mine"}
    )
    assert plan.rows == (("blocks.*.up", "column"), ("blocks.*.down", "row"))
    with pytest.raises(ConfigError, match="style one of"):
        TPPlan.from_dict({"rows": [["x", "diagonal"]]})
    with pytest.raises(ConfigError, match="needs 'rows'"):
        TPPlan.from_dict({"row": []})


def test_builtin_plans_by_class_name():
    names = {c: p.name for p in PLANS for c in p.classes}
    assert names["Qwen2ForCausalLM"] == names["MistralForCausalLM"] == "llama"

    class Decoder:  # plans are found by class name
        pass

    assert plan_for(Decoder()).name == "meshtrain decoder"
    assert plan_for(object()) is None


@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_shard_unshard_roundtrip_with_padding(t):
    import torch

    full = torch.randn(3 * 5 * 2, 7)  # 3 fused blocks of 5 heads of 2
    spec = ShardSpec(dim=0, units=5, unit=2, blocks=3, size=t)
    pieces = [shard_tensor(full, spec, r) for r in range(t)]
    assert all(p.shape == (spec.local, 7) for p in pieces)
    assert spec.local * t == 3 * spec.padded_units * 2
    assert torch.equal(unshard_pieces(pieces, spec), full)
    # rank r's q, k and v heads are the same heads
    u = spec.local_units
    q = full[:10].view(5, 2, 7)
    if t * u > 5:
        q = torch.cat((q, q.new_zeros(t * u - 5, 2, 7)))
    assert torch.equal(pieces[t - 1][: u * 2].view(u, 2, 7), q[(t - 1) * u : t * u])


@pytest.mark.parametrize("dim", [0, 1])
def test_shards_own_exactly_their_bytes(dim):
    """A shard is a copy of its own size: a dim-0 shard of an unfused weight is a contiguous
    slice, and a view there would keep the whole unsharded tensor alive with the model."""
    import torch

    full = torch.randn(8, 6)
    spec = ShardSpec(dim=dim, units=full.shape[dim], unit=1, blocks=1, size=2)
    for r in range(2):
        piece = shard_tensor(full, spec, r)
        assert piece.untyped_storage().nbytes() == piece.numel() * piece.element_size()
        assert piece.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()


@pytest.mark.parametrize(("t", "dim"), [(2, 0), (3, 1), (4, 0), (4, 1)])
def test_full_runs_map_shard_elements_to_full_indices(t, dim):
    import torch

    from meshtrain.parallel.tensor.sharding import full_runs

    shape = (3 * 5 * 2, 4) if dim == 0 else (4, 3 * 5 * 2)
    full = torch.arange(120, dtype=torch.float64).reshape(shape)
    spec = ShardSpec(dim=dim, units=5, unit=2, blocks=3, size=t)
    for r in range(t):
        local = shard_tensor(full, spec, r).reshape(-1)
        n = local.numel()
        for start, count in ((0, n), (3, n - 7), (n // 2, 1)):
            got = torch.full((count,), -1.0, dtype=torch.float64)
            for off, fstart, length in full_runs(
                spec, tuple(shard_tensor(full, spec, r).shape), r, start, count
            ):
                got[off : off + length] = full.reshape(-1)[fstart : fstart + length]
            want = local[start : start + count]
            real = got >= 0  # padding elements map nowhere (and are zero in the shard)
            assert torch.equal(got[real], want[real])
            assert torch.all(want[~real] == 0)


def test_estimate_counts_tensor_parallel_shards_exactly():
    from meshtrain.estimate.model_states import model_states_bytes
    from meshtrain.models import Decoder, DecoderConfig

    cfg = DecoderConfig(vocab_size=250, dim=48, n_layers=2, n_heads=6, ffn_dim=98, seed=3)
    model = Decoder(cfg)
    d = cfg.dim
    # tp 4 pads heads 6 -> 8, MLP 98 -> 100, vocabulary 250 -> 252; norms stay whole
    per_layer = 4 * d * (8 * 8) // 4 + 3 * d * 100 // 4 + 2 * d
    local = 2 * (252 * d // 4) + 2 * per_layer + d
    states = model_states_bytes(model, tp=4, stage=0, precision="fp32", optimizer="AdamW")
    assert states.params == 4 * local
    plain = model_states_bytes(1000, tp=4, stage=0, precision="fp32", optimizer="AdamW")
    assert plain.params == 4 * 250  # a bare count is divided by tp

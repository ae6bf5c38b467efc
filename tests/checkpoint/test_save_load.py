"""A 2-rank sharded save read back exactly, and bad saves that fail on every rank.

The saved values are the hand-made layouts of ``tests.checkpoint.common`` (contiguous
halves for "param", round-robin 3-element runs for "exp_avg", odd sizes and a 0-d tensor).
Reads are exact copies of stored bytes, so equality is exact (no tolerance).
"""

from __future__ import annotations

import json

import torch

from meshtrain.checkpoint import FORMAT_VERSION, CheckpointReader, latest_tag, list_tags
from tests.checkpoint.common import ALIASES, SHAPES, STATES, full_state


def test_two_rank_roundtrip(two_rank_checkpoint):
    save_dir, results = two_rank_checkpoint
    full = full_state(0)
    assert latest_tag(save_dir) == "global_step7"
    assert list_tags(save_dir) == ["global_step7"]
    assert results[0]["phases"] == [
        "shard_written",
        "manifest_written",
        "renamed",
        "latest_written",
    ]
    assert results[1]["phases"] == ["shard_written"]  # rank 1 only writes its shard
    assert sorted(p.name for p in (save_dir / "global_step7").iterdir()) == [
        "manifest.json",
        "rank00000.safetensors",
        "rank00001.safetensors",
    ]

    r = CheckpointReader(save_dir)  # resolves `latest`
    assert (r.tag, r.world_size, r.meta["step"]) == ("global_step7", 2, 7)
    assert r.names() == list(SHAPES) and r.names("exp_avg") == list(SHAPES)
    assert r.states() == sorted(STATES)
    assert r.aliases == ALIASES
    for state in STATES:
        for name, t in full[state].items():
            got = r.read_full(name, state)
            assert got.shape == t.shape and torch.equal(got, t), (name, state)
    assert torch.equal(r.read_full("head.weight"), full["param"]["embed.weight"])
    assert r.shape("head.weight") == (11, 6) and r.dtype("temperature") == torch.float32

    # every sub-range of a 66-element tensor stored as 2 halves and as 22 runs of 3
    for state in STATES:
        flat = full[state]["embed.weight"].reshape(-1)
        for start in range(0, 66, 5):
            for numel in sorted({min(n, 66 - start) for n in (0, 1, 2, 4, 7, 33, 66)}):
                got = r.read("embed.weight", state, start, numel)
                assert torch.equal(got, flat[start : start + numel]), (state, start, numel)
        chunks = list(r.iter_chunks("embed.weight", state, 4, 50, max_numel=5))
        assert max(c.numel() for _, c in chunks) <= 5
        assert torch.equal(torch.cat([c for _, c in chunks]), flat[4:54])
        assert [p for p, _ in chunks] == sorted(p for p, _ in chunks)

    for rank in (0, 1):
        st = r.rank_state(rank)
        assert st["sampler"] == {"epoch": 1, "consumed": 10 * rank}
        assert st["python_rng"][0] == 3 and len(st["python_rng"][1]) == 625
        rng = r.rank_tensor(rank, "rng.torch")
        assert rng.dtype == torch.uint8 and rng.shape == torch.get_rng_state().shape
    r.check_model({**SHAPES, "head.weight": (11, 6)})  # no error
    r.close()

    # the tag directory itself works too, and the manifest is plain JSON
    assert CheckpointReader(save_dir / "global_step7").tag == "global_step7"
    manifest = json.loads((save_dir / "global_step7" / "manifest.json").read_text())
    assert manifest["format_version"] == FORMAT_VERSION == 2 and len(manifest["ranks"]) == 2


def test_bad_saves_fail_on_every_rank(two_rank_checkpoint):
    save_dir, results = two_rank_checkpoint
    for rank, out in enumerate(results):
        errors = out["errors"]
        assert "rank 1:" in errors["bad_key"] and "'nope'" in errors["bad_key"], errors
        assert "uncovered" in errors["gap"] and "rank 0:" in errors["gap"]
        assert "rank_state (rank 0).sched.lr" in errors["not_json"]
        assert "Tensor is not JSON-able" in errors["not_json"]
        # none of them moved `latest` or left a directory behind
        assert out["latest_after_errors"] == "global_step7"
        assert out["entries"] == ["global_step7", "latest"], (rank, out["entries"])

"""``meshtrain.from_pretrained``: sliced loading equals transformers' load + the layout.

For tiny Llama, GPT-2 and BERT (masked LM) saved as sharded ``save_pretrained`` folders:
the model each rank builds and loads slice by slice, gathered, is bitwise equal to
``transformers``' ``from_pretrained`` followed by ``meshtrain.initialize`` on the same
layout, and so is the model after one AdamW step on the same batch (the same fp32
operations on the same values: exact, no tolerance). Missing and unexpected keys are
the ones transformers reports.
"""

from __future__ import annotations

import pytest

from tests.checkpoint import sliced_ranks
from tests.harness import run_ranks


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    sliced_ranks.save_folders(root)
    return root


@pytest.mark.parametrize("layout", ["zero3", "tp2"])
def test_sliced_load_equals_transformers_then_layout(folders, layout):
    results = run_ranks(sliced_ranks.parity, 2, str(folders), layout)
    for r in results:
        for kind in sliced_ranks.KINDS:
            loaded, stepped, _ = r[kind]
            assert loaded, (layout, kind, "loaded weights differ")
            assert stepped, (layout, kind, "the step after loading differs")
        missing, ref_missing, unexpected, ref_unexpected = r["info"]
        assert missing == ref_missing == ["model.norm.weight"]
        assert unexpected == ref_unexpected == ["extra.weight"]


def test_sliced_load_tp2_pp2(folders):
    """4 ranks: tp 2 x pp 2; each stage reads only its blocks' slices."""
    results = run_ranks(sliced_ranks.parity, 4, str(folders), "tp2pp2")
    for r in results:
        for kind in sliced_ranks.KINDS:
            loaded, stepped, bad = r[kind]
            assert loaded, ("tp2pp2", kind, "loaded weights differ", bad)
            assert stepped, ("tp2pp2", kind, "the step after loading differs")
        missing, ref_missing, unexpected, ref_unexpected = r["info"]
        assert missing == ref_missing == ["model.norm.weight"]
        assert unexpected == ref_unexpected == ["extra.weight"]


def test_from_pretrained_reads_meshtrain_checkpoint_and_exports(folders, tmp_path):
    """2 ranks: a meshtrain checkpoint (saved at ZeRO-3) loads at tp 2, its consolidated
    folder at ZeRO-3 and its one-file export at tp 2, each bitwise equal to the saved
    model (which one AdamW step moved away from the original folder)."""
    results = run_ranks(sliced_ranks.checkpoint_sources, 2, str(folders), str(tmp_path))
    for r in results:
        for name, (equal, moved) in r.items():
            assert moved, (name, "the saved model still equals the original folder")
            assert equal, (name, "the loaded model differs from the saved one")


def test_sliced_load_expert_parallel_converts_per_expert_tensors(tmp_path):
    """transformers 5 saves a Mixtral's and a Qwen2-MoE's experts one tensor per expert
    (Mixtral's under ``block_sparse_moe``) and fuses them on load; meshtrain's sliced load
    applies the same conversion. 2 ranks, ep 2 at ZeRO-1 and ZeRO-3: each rank's masters
    (its slice of the experts, its shards) are bitwise equal to transformers' load + the
    same layout, before and after one AdamW step."""
    from tests.distributed.test_moe import tiny_causal_lm

    for family in ("mixtral", "qwen2_moe"):
        tiny_causal_lm(family).save_pretrained(tmp_path / family, max_shard_size="20KB")
        for r in run_ranks(sliced_ranks.expert_parity, 2, str(tmp_path / family), family):
            assert r["unexpected"] == [] and r["missing"] == [], (family, r)
            for stage in (1, 3):
                loaded, stepped, groups = r[stage]
                assert groups >= 2, (family, stage, groups)  # expert and non-expert parts
                assert loaded, (family, stage, "loaded masters differ")
                assert stepped, (family, stage, "the step after loading differs")

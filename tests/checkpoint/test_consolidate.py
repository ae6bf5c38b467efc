"""Consolidated export: exact equality with the saved tensors, aliases, dtype casts, the
``meshtrain consolidate`` command, a save_pretrained folder transformers loads, and the
peak memory of streaming (measured in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from meshtrain import cli
from meshtrain.checkpoint import Piece, consolidate, save_shards
from meshtrain.checkpoint.consolidate import CHUNK_NUMEL
from tests.checkpoint.common import SHAPES, full_state
from tests.tiny_models import tiny_llama_config


def test_consolidate_two_rank_checkpoint(two_rank_checkpoint, tmp_path):
    save_dir, _ = two_rank_checkpoint
    full = full_state(0)["param"]
    out = consolidate(save_dir, tmp_path / "model.safetensors")
    got = load_file(out)
    assert list(got) == [*SHAPES, "head.weight"]  # state-dict order, then aliases
    for name, t in full.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], t), name
    assert torch.equal(got["head.weight"], full["embed.weight"])
    with safe_open(str(out), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert len(out.read_bytes()) % 8 == 0  # header padded: tensor data 8-byte aligned

    got = load_file(consolidate(save_dir, tmp_path / "bf16.safetensors", dtype="bf16"))
    for name, t in full.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], t.bfloat16())

    rc = cli.main(
        [
            "consolidate",
            str(save_dir),
            str(tmp_path / "cli.safetensors"),
            "--tag",
            "global_step7",
            "--dtype",
            "fp16",
        ]
    )
    assert rc == 0
    assert load_file(tmp_path / "cli.safetensors")["layer.w"].dtype == torch.float16
    assert cli.main(["consolidate", str(tmp_path / "none"), str(tmp_path / "x.safetensors")]) == 1


def test_model_dtype_and_buffers(tmp_path, capsys):
    """fp32 masters are written in the model dtype by default; int buffers keep theirs."""
    w = torch.randn(5, 3)
    steps = torch.arange(4, dtype=torch.int64)
    tensors = {"master": w.reshape(-1), "buf": steps, "empty": torch.empty(0)}
    meta = {
        "tensors": {
            "w": {"shape": [5, 3], "dtype": "bfloat16", "kind": "param"},
            "steps": {"shape": [4], "dtype": "int64", "kind": "buffer"},
            "nothing": {"shape": [0, 3], "dtype": "bfloat16", "kind": "param"},
        }
    }
    pieces = [Piece("w", "param", "master", 0, 0, 15), Piece("steps", "param", "buf", 0, 0, 4)]
    save_shards(tmp_path / "ck", "t", group=None, tensors=tensors, pieces=pieces, meta=meta)
    folder = consolidate(tmp_path / "ck", tmp_path / "folder")  # a folder, no hf_config
    assert sorted(p.name for p in folder.iterdir()) == [
        "meshtrain_checksums.json",  # the export's checksums (issue 32)
        "model.safetensors",
    ]
    got = load_file(folder / "model.safetensors")
    assert torch.equal(got["w"], w.bfloat16()) and torch.equal(got["steps"], steps)
    assert got["nothing"].shape == (0, 3) and got["nothing"].dtype == torch.bfloat16
    got = load_file(consolidate(tmp_path / "ck", tmp_path / "f32.safetensors", dtype="fp32"))
    assert torch.equal(got["w"], w) and got["steps"].dtype == torch.int64

    assert cli.main(["consolidate", str(tmp_path / "ck"), str(tmp_path / "c.safetensors")]) == 0
    printed = capsys.readouterr().out
    assert str(tmp_path / "c.safetensors") in printed and " B)" in printed


def test_hf_folder_loads_with_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = tiny_llama_config(num_attention_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    sd = model.state_dict()
    # the engine's view: tied lm_head is an alias of the embedding (first in state-dict order)
    canon, aliases, seen = {}, {}, {}
    for name, t in sd.items():
        ptr = t.data_ptr()
        if ptr in seen:
            aliases[name] = seen[ptr]
        else:
            seen[ptr], canon[name] = name, t
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    # two "ranks" of pieces by hand: each tensor's first 40% in key a, the rest in key b
    flat_a, flat_b, pieces, off_a, off_b = [], [], [], 0, 0
    for name, t in canon.items():
        flat, cut = t.detach().reshape(-1), int(t.numel() * 0.4)
        flat_a.append(flat[:cut])
        flat_b.append(flat[cut:])
        pieces += [
            Piece(name, "param", "a", off_a, 0, cut),
            Piece(name, "param", "b", off_b, cut, t.numel() - cut),
        ]
        off_a, off_b = off_a + cut, off_b + t.numel() - cut
    meta = {
        "tensors": {
            n: {"shape": list(t.shape), "dtype": "float32", "kind": "param"}
            for n, t in canon.items()
        },
        "aliases": aliases,
        "hf_config": cfg.to_dict(),
        "hf_model_class": "LlamaForCausalLM",
    }
    save_shards(
        tmp_path / "ck",
        "t",
        group=None,
        meta=meta,
        pieces=pieces,
        tensors={"a": torch.cat(flat_a), "b": torch.cat(flat_b)},
    )

    folder = consolidate(tmp_path / "ck", tmp_path / "hf")
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "meshtrain_checksums.json",  # the export's checksums (issue 32)
        "model.safetensors",
    ]
    assert "lm_head.weight" not in load_file(folder / "model.safetensors")
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    for name, t in sd.items():
        assert torch.equal(loaded.state_dict()[name], t), name
    ids = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(loaded(ids).logits, model(ids).logits)

    folder = consolidate(tmp_path / "ck", tmp_path / "hf16", dtype="bf16")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    for name, t in sd.items():
        assert torch.equal(loaded.state_dict()[name], t.bfloat16()), name


_PROBE = textwrap.dedent(
    """
    import json, sys
    import torch  # imported before the baseline, like everything else the export needs
    import safetensors, tqdm
    from meshtrain.checkpoint import CheckpointReader, consolidate

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    reader = CheckpointReader(sys.argv[1])
    base = status("VmRSS")
    consolidate(reader, sys.argv[2])
    print(json.dumps({"base": base, "hwm": status("VmHWM")}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_consolidate_peak_memory(tmp_path):
    """8 tensors of 32 MiB (256 MiB) in two rank-style halves; the export's peak RSS growth
    must stay well under the model (asserted < 3 x the largest tensor; streaming in
    CHUNK_NUMEL chunks keeps it near one 16 MiB chunk)."""
    n, count = 8 * 1024 * 1024, 8  # fp32: 32 MiB each
    tensors, pieces, meta = {}, [], {"tensors": {}}
    for i in range(count):
        name, half = f"layers.{i}.weight", n // 2 + 1001
        meta["tensors"][name] = {"shape": [n // 1024, 1024], "dtype": "float32", "kind": "param"}
        t = torch.arange(n, dtype=torch.float32).add_(i)
        tensors[f"{name}.lo"], tensors[f"{name}.hi"] = t[:half].clone(), t[half:].clone()
        pieces += [
            Piece(name, "param", f"{name}.lo", 0, 0, half),
            Piece(name, "param", f"{name}.hi", 0, half, n - half),
        ]
        del t
    save_shards(tmp_path / "ck", "t", group=None, tensors=tensors, pieces=pieces, meta=meta)
    del tensors
    out = tmp_path / "model.safetensors"
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(tmp_path / "ck"), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    growth, largest, total = m["hwm"] - m["base"], n * 4, count * n * 4
    mib = 1024 * 1024
    print(
        f"\nconsolidate peak RSS growth {growth / mib:.1f} MiB; largest tensor "
        f"{largest / mib:.0f} MiB, model {total / mib:.0f} MiB, chunk {CHUNK_NUMEL * 4 / mib:.0f} MiB"
    )
    assert growth < 3 * largest, (growth, largest, total)
    with safe_open(str(out), "pt") as f:  # spot-check content without loading it all
        assert torch.equal(
            f.get_slice("layers.5.weight")[3:4, 1020:1024].reshape(-1),
            torch.arange(3 * 1024 + 1020, 3 * 1024 + 1024).float() + 5,
        )

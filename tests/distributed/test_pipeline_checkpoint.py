"""Checkpoints reshard across pipeline sizes with no conversion step (4 ranks, then 1).

The reference decoder with its LM head tied to the embedding, 4 blocks, AdamW, ZeRO 1,
4 micro-batches of 4 rows per step (varying sequence lengths). Saved at pp 2 x dp 2 with
the interleaved schedule (2 virtual stages per rank: stages 0 and 2 on pp rank 0) after
2 steps; the same run continues 2 more. Loaded at pp 1 x dp 4, at pp 4 x dp 1 (1F1B) and
in one process (pp 1), each continuing the same 2 steps on the same global batches:
per-step losses and the final parameters (normwise) within ``trajectory(1e-2, 2)``
(``tests/tolerance.py``) of the uninterrupted run (fp32; the data-parallel mean and the
tied embedding's gradient
sum run in another order under another layout, as in the parity tests). Loaded at the
same layout it continues bit-identically. A ``PipelineModule`` (tied ``TiedLayerSpec``
embedding, names ``layers.<i>`` / ``tied_modules.<key>``) saved at pp 2 x dp 2 loads at
pp 4 and whole in one process, same tolerances. ``module_state_dict()`` under pp is the
unsplit model's state dict (keys and order of ``Decoder.state_dict()``) on every rank,
and ``meshtrain consolidate`` of the pp checkpoint equals it exactly (for a tied tiny
Llama too, through a folder ``from_pretrained`` loads). The tied embedding
is written once (by the first stage's ranks only). Loading into a different model
raises CheckpointError naming the mismatched tensors. ``memory_report`` at pp 2 x dp 2
and pp 4: see ``_check_memory`` (exact bytes).
"""

from __future__ import annotations

import torch

from tests.harness import run_ranks
from tests.tolerance import check, trajectory

ROWS, M = 4, 4
ADAMW = {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}


def _data(step: int, part: slice, vocab: int = 64):
    g = torch.Generator().manual_seed(900 + step)
    out = []
    for i in range(M):
        ids = torch.randint(0, vocab, (ROWS, 5 + (i + step) % 4), generator=g)[part]
        out.append((ids, ids))
    return out


def _config(pp: int, dp: int, schedule: str, v: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": ROWS // dp,
        "gradient_accumulation_steps": M,
        "optimizer": {"type": "AdamW", "params": ADAMW},
        "steps_per_print": 1000,
        "mesh": {"pipeline_parallel_size": pp},
        "zero_optimization": {"stage": 1},
        "pipeline": {"schedule": schedule, "virtual_stages": v},
    }


def _decoder(**overrides):
    from meshtrain.models import Decoder, DecoderConfig

    torch.manual_seed(0)
    cfg = dict(vocab_size=64, dim=32, n_layers=4, n_heads=2, ffn_dim=48, max_seq_len=16)
    return Decoder(DecoderConfig(**{**cfg, **overrides}, tie_embeddings=True))


def _engine(pp: int, schedule: str = "1f1b", v: int = 1, **overrides):
    import torch.distributed as dist

    import meshtrain

    dp = dist.get_world_size() // pp
    config = _config(pp, dp, schedule, v)
    return meshtrain.initialize(model=_decoder(**overrides), config=config)[0]


def _pipe_engine(pp: int, v: int = 1):
    import torch.distributed as dist

    import meshtrain
    from meshtrain.distributed.topology import Topology
    from meshtrain.pipe import PipelineModule
    from tests.tiny_models import tiny_pipe_layers

    topo = Topology(pp=pp) if dist.get_world_size() > 1 else None
    layers, loss_fn = tiny_pipe_layers()
    model = PipelineModule(layers, topology=topo, loss_fn=loss_fn, virtual_stages=v)
    dp = dist.get_world_size() // pp
    config = _config(pp, dp, "interleaved_1f1b" if v > 1 else "1f1b", v)
    return meshtrain.initialize(model=model, config=config, topology=topo)[0]


def _steps(engine, first: int, n: int, vocab: int = 64) -> list[float]:

    from meshtrain.pipe import PipelineModule

    dp, r = engine.topology.dp_size, engine.topology.dp_rank
    rows = ROWS // dp
    out = []
    for step in range(first, first + n):
        batches = _data(step, slice(r * rows, (r + 1) * rows), vocab)
        if isinstance(engine.module, PipelineModule):
            out.append(_whole_pipeline_module_step(engine, batches))
            continue
        out.append(engine.train_batch(iter(batches)).item())  # the mean over dp replicas
    return out


def _whole_pipeline_module_step(engine, batches) -> float:
    """A PipelineModule at pp 1 returns the output, not the loss: apply ``loss_fn``."""
    losses = []
    for x, y in batches:
        loss = engine.module.loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    return torch.stack(losses).mean().item()


def _compare(engine, first: int, cont: list[float], final: dict, vocab: int = 64) -> dict:
    losses = _steps(engine, first, len(cont), vocab)
    state = engine.module_state_dict()
    num = sum(float((state[k] - final[k]).pow(2).sum()) for k in final)
    den = sum(float(final[k].pow(2).sum()) for k in final)
    return {
        "loss": max(abs(x - y) / abs(y) for x, y in zip(losses, cont, strict=True)),
        "params": (num / den) ** 0.5,
        "keys": sorted(state) == sorted(final),
        "exact": losses == cont and all(torch.equal(state[k], final[k]) for k in final),
        "global_steps": engine.global_steps,
    }


def _four_ranks(tmp: str) -> dict:
    import json

    import pytest
    import torch.distributed as dist

    from meshtrain.checkpoint.consolidate import consolidate
    from meshtrain.errors import CheckpointError

    torch.set_num_threads(1)
    out: dict = {}
    # --- the reference decoder: pp 2 x dp 2, interleaved ---------------------------------
    a = _engine(2, "interleaved_1f1b", 2)
    _steps(a, 0, 2)
    path = a.save_checkpoint(tmp, tag="dec")
    saved = a.module_state_dict()
    cont = _steps(a, 2, 2)
    final = a.module_state_dict()
    out["order"] = list(saved) == list(_decoder().state_dict())
    out["mem_a"] = _memory(a)
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        full = load_file(str(consolidate(path, f"{tmp}/full.safetensors")))
        out["consolidated"] = sorted(full) == sorted(saved) and all(
            torch.equal(full[k], saved[k]) for k in saved
        )
        manifest = json.loads((path / "manifest.json").read_text())
        out["embed_writers"] = sorted(
            {
                e["rank"]
                for e in manifest["ranks"]
                for p in e["pieces"]
                if p["name"] == "embed.weight"
            }
        )
        out["tensors"] = sorted(manifest["meta"]["tensors"])
        out["aliases"] = manifest["meta"]["aliases"]
    for name, pp, schedule, v in (("pp1", 1, "1f1b", 1), ("pp4", 4, "1f1b", 1)):
        e = _engine(pp, schedule, v)
        e.load_checkpoint(tmp, tag="dec")
        out[name] = _compare(e, 2, cont, final)
        if pp == 4:
            out["mem_pp4"] = _memory(e)
    same = _engine(2, "interleaved_1f1b", 2)
    same.load_checkpoint(tmp, tag="dec")
    out["same"] = _compare(same, 2, cont, final)
    bad = _engine(2, "1f1b", 1, ffn_dim=40)
    with pytest.raises(CheckpointError, match="does not match the model") as err:
        bad.load_checkpoint(tmp, tag="dec")
    out["bad"] = str(err.value)
    out["hf"] = _llama_round_trip(tmp)
    # --- PipelineModule: pp 2 x dp 2 -> pp 4 ---------------------------------------------
    pm = _pipe_engine(2)
    _steps(pm, 0, 2, vocab=32)
    pm.save_checkpoint(tmp, tag="pipe")
    pm_cont = _steps(pm, 2, 2, vocab=32)
    pm_final = pm.module_state_dict()
    out["pipe_keys"] = list(pm_final)
    out["pipe_pp4"] = _compare(_loaded(_pipe_engine(4), tmp), 2, pm_cont, pm_final, vocab=32)
    return {"out": out, "cont": cont, "final": final, "pm_cont": pm_cont, "pm_final": pm_final}


def _memory(engine) -> dict:
    """memory_report's numbers, this rank's parameter count and scalar ``step`` tensors."""
    rep = engine.memory_report()
    m, f, pipe = rep.measured, rep.formula, rep.pipeline
    steps = sum(
        t.numel() * t.element_size()
        for st in engine.optimizer.state.values()
        for k, t in st.items()
        if k == "step" and isinstance(t, torch.Tensor)
    )
    psi = sum(p.numel() for p in {id(p): p for p in engine.module.parameters()}.values())
    return {
        "measured": (m.params, m.grads, m.optimizer),
        "formula": (f.params, f.grads, f.optimizer),
        "steps": steps,
        "psi": psi,
        "pp_rank": engine.topology.pp_rank,
        "pipeline": (pipe.stages, pipe.peak_micro_batches, pipe.activations, pipe.seq_len),
        "text": str(rep),
    }


def _llama_round_trip(tmp: str) -> bool | None:
    """A tied tiny Llama saved at pp 2 x dp 2 consolidates (rank 0) into a folder that
    ``from_pretrained`` loads, equal to ``module_state_dict()`` exactly."""
    import torch.distributed as dist
    import transformers

    import meshtrain
    from meshtrain.checkpoint.consolidate import consolidate
    from tests.tiny_models import tiny_llama

    model = tiny_llama(tie_word_embeddings=True)
    engine = meshtrain.initialize(model=model, config=_config(2, 2, "1f1b", 1))[0]
    _steps(engine, 0, 1)
    path = engine.save_checkpoint(tmp, tag="llama")
    state = engine.module_state_dict()
    ok = None
    if dist.get_rank() == 0:
        folder = consolidate(path, f"{tmp}/llama_hf")
        loaded = transformers.LlamaForCausalLM.from_pretrained(folder).state_dict()
        ok = sorted(loaded) == sorted(state) and all(
            torch.equal(loaded[k], state[k]) for k in state
        )
    dist.barrier()
    return ok


def _loaded(engine, tmp: str):
    engine.load_checkpoint(tmp, tag="pipe")
    return engine


def _one_process(tmp: str, ref: dict) -> dict:
    torch.set_num_threads(1)
    e = _engine(1)
    e.load_checkpoint(tmp, tag="dec")
    pm = _loaded(_pipe_engine(1), tmp)
    return {
        "dec": _compare(e, 2, ref["cont"], ref["final"]),
        "pipe": _compare(pm, 2, ref["pm_cont"], ref["pm_final"], vocab=32),
    }


def _check_close(o: dict, what: str) -> None:
    assert o["keys"] and o["global_steps"] == 4, (what, o)
    check(f"{what} losses", o["loss"], trajectory(ADAMW["lr"], 2))  # the 2 steps after loading
    check(f"{what} parameters", o["params"], trajectory(ADAMW["lr"], 2))


def test_pipeline_checkpoint_reshards(tmp_path):
    results = run_ranks(_four_ranks, 4, str(tmp_path), timeout=600)
    first = results[0]["out"]
    assert first["consolidated"]
    assert first["hf"], "a pp checkpoint of a tied Llama -> consolidate -> from_pretrained"
    # written once: by pp rank 0's ranks (0, 1) only, in their ZeRO-1 ranges; never by the
    # last stage's ranks (2, 3), which hold it too
    assert first["embed_writers"] and set(first["embed_writers"]) <= {0, 1}
    assert "lm_head.weight" not in first["tensors"]
    assert first["aliases"] == {"lm_head.weight": "embed.weight"}
    pipe_names = {k.split(".")[0] + "." + k.split(".")[1] for k in first["pipe_keys"]}
    assert pipe_names == {f"layers.{i}" for i in range(1, 6)} | {"tied_modules.embed"}
    for r in results:
        out = r["out"]
        assert out["order"], "module_state_dict under pp: the unsplit model's keys, in order"
        _check_close(out["pp1"], "pp2xdp2 -> pp1xdp4")
        _check_close(out["pp4"], "pp2xdp2 -> pp4")
        _check_close(out["pipe_pp4"], "PipelineModule pp2xdp2 -> pp4")
        assert out["same"]["exact"], out["same"]
        assert "shape mismatches" in out["bad"] and "layers.0.mlp" in out["bad"], out["bad"]
    _check_memory([r["out"] for r in results])
    single = run_ranks(_one_process, 1, str(tmp_path), results[0], timeout=300)[0]
    for what, o in (*((k, first[k]) for k in ("pp1", "pp4", "pipe_pp4")), *single.items()):
        print(f"reshard {what}: loss {o['loss']:.2e} params {o['params']:.2e}")
    _check_close(single["dec"], "pp2xdp2 -> one process")
    _check_close(single["pipe"], "PipelineModule pp2xdp2 -> one process")


def _check_memory(outs: list[dict]) -> None:
    """memory_report at pp 2 x dp 2 (ZeRO 1, fp32 AdamW, 4 stages of one block): model
    states exactly the formula over this pp rank's parameters (the optimizer's scalar
    ``step`` tensors are the only extra bytes), the same as ``meshtrain estimate``'s
    per-rank rows; peak micro-batches from the schedule; activations by the formula."""
    from meshtrain.estimate.pipeline import pipeline_memory
    from meshtrain.parallel.pipeline.schedules import build_schedule
    from meshtrain.parallel.pipeline.validate import peak_alive

    with torch.device("meta"):
        rows = pipeline_memory(
            _decoder(), pp=2, m=M, schedule="interleaved_1f1b", virtual_stages=2, dp=2,
            stage=1, precision="fp32", optimizer="AdamW", micro_batch_size=ROWS // 2,
        )  # fmt: skip
    block = 2 * 32 + 4 * 32 * 32 + 3 * 32 * 48  # two norms, q k v o, gate up down
    peaks = peak_alive(build_schedule("interleaved_1f1b", 2, M, 2), per="rank")
    for out in outs:
        mem, r = out["mem_a"], out["mem_a"]["pp_rank"]
        psi = mem["psi"]
        assert psi == 2 * block + 64 * 32 + (32 if r else 0), mem  # embed / norm + tied head
        assert mem["formula"] == (4 * psi, 4 * psi, 8 * psi // 2), mem
        assert mem["measured"][:2] == mem["formula"][:2], mem
        assert mem["measured"][2] == mem["formula"][2] + mem["steps"] and mem["steps"] > 0, mem
        assert (rows[r].trainable, rows[r].states.total) == (psi, sum(mem["formula"])), rows[r]
        stages, peak, _, _ = mem["pipeline"]
        assert stages == (r, r + 2) and peak == peaks[r] == 2 + 2 * (1 - r) + 1, mem
        assert "pipeline: pp rank" in mem["text"] and "measured / formula" in mem["text"]
        # pp 4, 1F1B, micro-batches of 4 x 16 tokens (max_seq_len), fp32 (w = 4 bytes)
        mem = out["mem_pp4"]
        r = mem["pp_rank"]
        stages, peak, acts, seq = mem["pipeline"]
        b, s, h, a, w = 4, 16, 32, 2, 4
        per_block = s * b * h * (16 * w + 2) + a * s * s * b * (2 * w + 1)
        head = b * s * 64 * (w + 4) if r == 3 else 0
        assert (stages, peak, seq) == ((r,), 4 - r, 16), mem
        assert acts == (4 - r) * (per_block + head), mem

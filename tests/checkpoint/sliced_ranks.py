"""Rank functions of the sliced-loading tests (tests.harness)."""

from __future__ import annotations

import torch

KINDS = ("llama", "gpt2", "bert_mlm")


def save_folders(root) -> None:
    """Each kind's tiny model as a *sharded* save_pretrained folder (several files and an
    index), plus a missing/unexpected-key variant of the Llama one."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from tests.distributed.tp_models import build

    for kind in KINDS:
        build(kind).save_pretrained(Path(root) / kind, max_shard_size="20KB")
    # llama without its final norm, with one extra tensor: both must be reported
    src, dst = Path(root) / "llama", Path(root) / "llama_keys"
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    state = {}
    index = json.loads((src / "model.safetensors.index.json").read_text())
    for f in sorted(set(index["weight_map"].values())):
        state.update(load_file(str(src / f)))
    del state["model.norm.weight"]
    state["extra.weight"] = torch.ones(3)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})


def _config(layout: str, world: int) -> dict:
    tp = 2 if layout.startswith("tp") else 1
    pp = 2 if layout == "tp2pp2" else 1
    dp = world // (tp * pp)
    return {
        "train_micro_batch_size_per_gpu": 4 // dp,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "mesh": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp},
        "zero_optimization": {
            "stage": 3 if layout == "zero3" else 1,
            "stage3_param_persistence_threshold": 0,
        },  # fmt: skip
        "steps_per_print": 1000,
    }


def _step(engine, kind):
    from tests.distributed.tp_models import batch, loss_of

    dp, d = engine.topology.dp_size, engine.topology.dp_rank
    full = batch(kind, 0, 4)
    m = 4 // dp
    mine = {k: v[d * m : (d + 1) * m] for k, v in full.items()}
    if engine.pipeline is not None:
        engine.train_batch(iter([mine]))
        return
    loss = loss_of(engine, kind, mine)
    engine.backward(loss)
    engine.step()


def _held(engine) -> dict:
    """What this rank holds, comparably: the gathered whole model, or under pp each
    stage's own (tp-sharded) tensors. (``module_state_dict`` under tp x pp broadcasts tp
    shards into full-shape buffers, so it is not used there.)"""
    if engine.pipeline is None:
        return engine.module_state_dict()
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def parity(root, layout, kinds=KINDS):
    """For each kind: transformers' from_pretrained + meshtrain.initialize vs
    meshtrain.from_pretrained on the same layout; gathered state dicts bitwise equal,
    before and after one AdamW step on the same batch."""
    import torch.distributed as dist
    import transformers

    import meshtrain
    from tests.distributed.tp_models import build

    out = {}
    world = dist.get_world_size()
    for kind in kinds:
        folder = f"{root}/{kind}"
        cls = type(build(kind))
        ref_model = cls.from_pretrained(folder, dtype=torch.float32)
        ref, *_ = meshtrain.initialize(model=ref_model, config=_config(layout, world))
        ours, *_ = meshtrain.from_pretrained(folder, _config(layout, world))
        a, b = _held(ref), _held(ours)
        loaded = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        _step(ref, kind)
        _step(ours, kind)
        a, b = _held(ref), _held(ours)
        stepped = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        out[kind] = (loaded, stepped, [k for k in a if not torch.equal(a[k], b.get(k, a[k] + 1))])
    (_, info) = meshtrain.from_pretrained(
        f"{root}/llama_keys", _config(layout, world), output_loading_info=True
    )
    ref_model, ref_info = transformers.LlamaForCausalLM.from_pretrained(
        f"{root}/llama_keys", output_loading_info=True
    )
    out["info"] = (
        sorted(info["missing_keys"]), sorted(ref_info["missing_keys"]),
        sorted(info["unexpected_keys"]), sorted(ref_info["unexpected_keys"]),
    )  # fmt: skip
    return out


def checkpoint_sources(root, out):
    """The same path from a meshtrain checkpoint and from its consolidated exports.

    A Llama loaded the transformers way at ZeRO-3 takes one AdamW step (so its weights
    are no longer the folder's) and is saved as a meshtrain checkpoint; then
    ``meshtrain.from_pretrained`` loads that checkpoint at tp 2, its consolidated
    ``save_pretrained`` folder at ZeRO-3, and its one-file export (config.json beside it)
    at tp 2. Each gathered model must equal the saved one bitwise (values are copied)."""
    import shutil
    from pathlib import Path

    import torch.distributed as dist
    import transformers

    import meshtrain
    from meshtrain.checkpoint import consolidate

    world = dist.get_world_size()
    out = Path(out)
    model = transformers.LlamaForCausalLM.from_pretrained(f"{root}/llama", dtype=torch.float32)
    ref, *_ = meshtrain.initialize(model=model, config=_config("zero3", world))
    _step(ref, "llama")
    ref.save_checkpoint(str(out / "ck"))
    want = _held(ref)
    if dist.get_rank() == 0:
        consolidate(out / "ck", out / "export")  # model.safetensors + config.json
        (out / "one").mkdir()
        consolidate(out / "ck", out / "one" / "model.safetensors")
        shutil.copy(out / "export" / "config.json", out / "one" / "config.json")
    dist.barrier()
    results = {}
    for name, path, layout in (
        ("meshtrain checkpoint", out / "ck", "tp2"),
        ("consolidated folder", out / "export", "zero3"),
        ("one-file export", out / "one" / "model.safetensors", "tp2"),
    ):
        engine, *_ = meshtrain.from_pretrained(path, _config(layout, world))
        got = _held(engine)
        results[name] = (
            got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want),
            any(not torch.equal(want[k], model_k) for k, model_k in _folder(root).items()),
        )
    return results


def _folder(root) -> dict:
    """The tiny Llama folder's tensors (to check the step moved the weights)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    index = json.loads((Path(root) / "llama" / "model.safetensors.index.json").read_text())
    state = {}
    for f in sorted(set(index["weight_map"].values())):
        state.update(load_file(str(Path(root) / "llama" / f)))
    return state


def expert_parity(root, family):
    """ep 2 (ZeRO-1, ZeRO-3): ``meshtrain.from_pretrained`` of a tiny MoE folder against
    transformers' ``from_pretrained`` + ``meshtrain.initialize``; each rank's fp32 masters
    bitwise, before and after one AdamW step on the same batch; and the loading info."""
    import transformers

    import meshtrain

    cls = {
        "mixtral": transformers.MixtralForCausalLM,
        "qwen2_moe": transformers.Qwen2MoeForCausalLM,
    }
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (2, 8), generator=g)
    out = {}
    for stage in (1, 3):
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "mesh": {"expert_parallel_size": 2},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "steps_per_print": 1000,
            "loss": {"global_aux_loss": True},  # compared with one process on the whole batch
        }
        ref_model = cls[family].from_pretrained(root, dtype=torch.float32)
        ref, *_ = meshtrain.initialize(model=ref_model, config=config)
        (ours, *_), info = meshtrain.from_pretrained(root, config, output_loading_info=True)
        out["missing"], out["unexpected"] = info["missing_keys"], info["unexpected_keys"]
        states = []
        for engine in (ref, ours):
            mine = ids[engine.topology.dp_rank : engine.topology.dp_rank + 1]
            before = _masters(engine)
            loss = engine(input_ids=mine, labels=mine).loss
            engine.backward(loss)
            engine.step()
            states.append((before, _masters(engine)))
        (a0, a1), (b0, b1) = states
        out[stage] = (
            a0.keys() == b0.keys() and all(torch.equal(a0[k], b0[k]) for k in a0),
            a1.keys() == b1.keys() and all(torch.equal(a1[k], b1[k]) for k in a1),
            len(a0),
        )
    return out


def _masters(engine) -> dict:
    """This rank's fp32 masters, group by group: exactly what it holds under any stage."""
    return {
        f"g{i}": torch.cat([c.detach().flatten() for c in g.master_chunks]).clone()
        for i, g in enumerate(engine.zero.flat_groups)
    }

"""Rank functions of the torch DCP proof (tests/interop/test_dcp_checkpoints.py).

FSDP2 (``fully_shard`` on every decoder layer and the root, ``init_device_mesh("cpu",
(2,))``) trains a tiny transformers Llama with torch's AdamW for ``SAVE_AT`` steps, saves
with ``torch.distributed.checkpoint.save`` in torchtitan's layout (the model's keys at the
top, ``optimizer`` from ``get_optimizer_state_dict(flatten_optimizer_state_dict=True)``,
``train_state``), and in a plain script's layout (``{"model": ..., "optimizer": ...}`` from
``get_state_dict``), then goes on for ``STEPS`` more (its own continuation from the state
it saved). meshtrain builds the same model at another rank count or ZeRO stage, resumes
with ``engine.load_checkpoint`` and trains the same ``STEPS`` on the same global batches.
The other way: meshtrain at ZeRO-3 writes DCP (``checkpoint.format: dcp``) and FSDP2
loads it with torch's own ``dcp.load`` and continues.
"""

from __future__ import annotations

import torch

from tests.tiny_models import tiny_llama

SAVE_AT = 3
STEPS = 10
GLOBAL = 8  # rows per optimizer step, split evenly over the ranks
SEQ = 16
LR = 1e-3
WD = 0.01
VOCAB = 64  # tests.tiny_models.LLAMA_DEFAULTS


def global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g)


def rows(step: int) -> torch.Tensor:
    """This rank's rows of the step's global batch."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    per = GLOBAL // world
    return global_batch(step)[rank * per : (rank + 1) * per]


def mean_over_ranks(loss: torch.Tensor) -> float:
    import torch.distributed as dist

    t = loss.detach().double().reshape(1)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def fsdp2_model(seed: int = 0):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_llama(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp2_train(model, opt, first: int, steps: int) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        ids = rows(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
    return losses


def full_state(model) -> dict[str, torch.Tensor] | None:
    """The whole model's weights on rank 0 (FSDP2 gathers them), None elsewhere."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(model, options=opts)
    return {k: v.clone() for k, v in sd.items()} if dist.get_rank() == 0 else None


def fsdp2_writes(out: str) -> dict:
    """FSDP2: ``SAVE_AT`` steps, DCP saves to ``out/titan`` and ``out/plain``, ``STEPS``
    more. Returns the continued losses and the weights at the save and at the end."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
    )

    model = fsdp2_model()
    if dist.get_rank() == 0:  # DCP holds no model config: from_pretrained reads it here
        model.config.save_pretrained(out)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    fsdp2_train(model, opt, 0, SAVE_AT)
    titan = dict(get_model_state_dict(model))  # torchtitan: the model's keys at the top
    titan["optimizer"] = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    titan["train_state"] = {"step": SAVE_AT}
    dcp.save(titan, checkpoint_id=f"{out}/titan")
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=f"{out}/plain")
    saved = full_state(model)
    losses = fsdp2_train(model, opt, SAVE_AT, STEPS)
    return {"losses": losses, "saved": saved, "state": full_state(model)}


def engine_config(stage: int, extra: dict | None = None) -> dict:
    import torch.distributed as dist

    return {
        "train_micro_batch_size_per_gpu": GLOBAL // dist.get_world_size(),
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
        **(extra or {}),
    }


def engine_train(engine, first: int, steps: int) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        ids = rows(step)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(mean_over_ranks(loss))
    return losses


def meshtrain_resumes(ckpt: str, stage: int) -> dict:
    """meshtrain at this world size and ZeRO ``stage``: ``engine.load_checkpoint`` on
    FSDP2's DCP folder, then ``STEPS`` steps. Returns what the test compares."""
    import torch.distributed as dist

    import meshtrain

    model = tiny_llama(seed=1)  # other weights than FSDP2's: the checkpoint must replace them
    engine, *_ = meshtrain.initialize(
        model=model, model_parameters=model.parameters(), config=engine_config(stage)
    )
    path, client = engine.load_checkpoint(ckpt)
    opt_states = [s for s in engine.optimizer.state.values() if "exp_avg" in s]
    resumed = {
        "path": str(path),
        "client_state": client,
        "global_steps": engine.global_steps,
        "step": float(opt_states[0]["step"]) if opt_states else None,
        "lr": engine.optimizer.param_groups[0]["lr"],
        "weight_decay": engine.optimizer.param_groups[0]["weight_decay"],
    }
    losses = engine_train(engine, SAVE_AT, STEPS)
    state = {k: v.detach().clone() for k, v in engine.module_state_dict().items()}
    return {**resumed, "losses": losses, "state": state if dist.get_rank() == 0 else None}


def meshtrain_from_pretrained(folder: str, stage: int) -> dict | None:
    """``meshtrain.from_pretrained`` on a DCP folder: the weights only, this layout's slices."""
    import torch.distributed as dist

    import meshtrain

    engine, *_ = meshtrain.from_pretrained(folder, config=engine_config(stage))
    state = {k: v.detach().clone() for k, v in engine.module_state_dict().items()}
    return {"state": state, "global_steps": engine.global_steps} if dist.get_rank() == 0 else None


def meshtrain_writes(out: str) -> dict:
    """meshtrain ZeRO-3: ``SAVE_AT`` steps, ``save_checkpoint`` in DCP, ``STEPS`` more."""
    import torch.distributed as dist

    import meshtrain

    model = tiny_llama(seed=0)
    config = engine_config(3, {"checkpoint": {"format": "dcp"}})
    engine, *_ = meshtrain.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    engine_train(engine, 0, SAVE_AT)
    path = engine.save_checkpoint(out)
    losses = engine_train(engine, SAVE_AT, STEPS)
    state = {k: v.detach().clone() for k, v in engine.module_state_dict().items()}
    return {"path": str(path), "losses": losses, "state": state if dist.get_rank() == 0 else None}


def fsdp2_loads(folder: str) -> dict:
    """FSDP2 with torch's own DCP API (torchtitan's keys): load meshtrain's checkpoint into
    a fresh model and AdamW, then ``STEPS`` steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = fsdp2_model(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    sd = dict(get_model_state_dict(model))
    sd["optimizer"] = get_optimizer_state_dict(model, opt, options=flat)
    dcp.load(sd, checkpoint_id=folder)
    optim_sd = sd.pop("optimizer")
    set_model_state_dict(model, sd)
    set_optimizer_state_dict(model, opt, optim_sd, options=flat)
    step = float(next(iter(opt.state.values()))["step"])
    losses = fsdp2_train(model, opt, SAVE_AT, STEPS)
    return {"step": step, "losses": losses, "state": full_state(model)}


class RunsCode:
    """A pickle that would run a shell command when unpickled (what a hostile file does)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def other_model_dcp(folder: str) -> None:
    """A DCP checkpoint of another model (a wider Llama), written by torch's dcp.save."""
    import torch.distributed.checkpoint as dcp

    dcp.save(dict(tiny_llama(0, hidden_size=48).state_dict()), checkpoint_id=folder)


def bad_inputs(folders: dict, other: str) -> dict:
    """One rank, ZeRO 1: ``engine.load_checkpoint`` on each bad folder; the messages."""
    import meshtrain
    from meshtrain.errors import CheckpointError

    other_model_dcp(other)
    out = {}
    for what, folder in {**folders, "other model": other}.items():
        model = tiny_llama(0)
        engine, *_ = meshtrain.initialize(
            model=model, model_parameters=model.parameters(), config=engine_config(1)
        )
        try:
            engine.load_checkpoint(folder)
            out[what] = None
        except CheckpointError as exc:
            out[what] = str(exc)
    return out

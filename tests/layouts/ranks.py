"""What each rank of a matrix group runs: several layouts one after the other (each a
fresh ``meshtrain.initialize`` on the same process group, so one spawn serves many), the
one-process reference, and the refusals initialized for real.

A trained layout returns, on rank 0, its per-step losses and the whole model (every
stage's parameters, tp shards and ep slices gathered, ZeRO-3 partitions made whole) in the
unsplit model's names; the reference is plain PyTorch on one process: each step ``MICRO``
micro-batches of every replica's rows, ``loss / MICRO`` backward (gradient accumulation),
one ``torch.optim.AdamW`` step.
"""

from __future__ import annotations

from tests.layouts.matrix import MICRO, ROWS, SEQ, VOCAB, build

WEIGHT_DECAY = 0.01


def lr(name: str) -> float:
    """1e-3 for the Decoder (its 0.02-std init leaves near-zero gradients that Adam's
    normalised update amplifies; ``tests/distributed/test_moe.py`` measured why), 1e-2 for
    the transformers models."""
    return 1e-3 if name == "decoder" else 1e-2


def micro_batches(step: int, dp: int, replica: int | None) -> list[dict]:
    """The step's ``MICRO`` micro-batches; ``replica``: that replica's rows (None: all)."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(MICRO):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        if replica is not None:
            rows = ROWS // dp
            ids = ids[replica * rows : (replica + 1) * rows]
        out.append({"input_ids": ids, "labels": ids})
    return out


def config(name: str, layout, extra: dict | None = None) -> dict:
    """The meshtrain config of ``layout`` (``Layout.config``, fp32) with the test's
    optimizer; MoE: the auxiliary loss over every replica's tokens, as one process
    computes it on the whole micro-batch (``loss.global_aux_loss``, docs/moe.md)."""
    out = layout.config("fp32")
    out["optimizer"] = {"type": "AdamW", "params": {"lr": lr(name), "weight_decay": WEIGHT_DECAY}}
    out["steps_per_print"] = 10_000
    if name == "mixtral":
        out["loss"] = {"global_aux_loss": True}
    out.update(extra or {})
    return out


def reference(name: str, steps: int) -> tuple[list[float], dict]:
    """One process, plain PyTorch (module docstring)."""
    import torch

    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=lr(name), weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(steps):
        total = 0.0
        for batch in micro_batches(step, 1, None):
            out = model(**batch)
            loss = out if isinstance(out, torch.Tensor) else out.loss
            (loss / MICRO).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / MICRO)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def whole_model(engine) -> dict:
    """Every parameter of the unsplit model, on every rank (module docstring): this rank's
    stages' parameters made whole over ZeRO-3 (``gathered_parameters``), tp
    (``unshard_tensor``) and ep (an all-gather of the expert slices along dim 0), then the
    pp ranks' dicts merged (``all_gather_object``: the models are tiny)."""
    import torch
    import torch.distributed as dist

    from meshtrain.parallel.experts import is_expert_param
    from meshtrain.parallel.tensor.sharding import specs_by_param, unshard_tensor

    topo, module = engine.topology, engine.module
    mine = {}
    with engine.gathered_parameters():
        if engine.pipeline is None:
            params = dict(module.named_parameters())
        else:
            params = {n: p for s in module.stages.values() for n, p in s.names.items()}
        specs = specs_by_param(module)
        for name in sorted(params):  # one order on every rank of a group
            p = params[name]
            t = p.detach()
            spec = specs.get(id(p))
            if spec is not None:
                t = unshard_tensor(t, spec, topo.tp_group)
            if is_expert_param(p) and topo.ep_size > 1:
                eg = topo.group("ep")
                parts = [torch.empty_like(t) for _ in range(eg.size)]
                dist.all_gather(parts, t.contiguous(), group=eg.pg)
                t = torch.cat(parts)
            mine[name] = t.clone()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged: dict = {}
    for part in every:
        merged.update(part)
    return merged


def mesh(layout, meshes: dict):
    """The ``Topology`` of ``layout``'s sizes, one per distinct mesh in a group: every
    ``initialize`` would otherwise make new process groups, and gloo keeps each group's
    threads until the process ends (hundreds per rank over a long group)."""
    from meshtrain.distributed.topology import Topology

    key = (layout.pp, layout.tp, layout.cp, layout.ep)
    if key not in meshes:
        meshes[key] = Topology(pp=layout.pp, tp=layout.tp, cp=layout.cp, ep=layout.ep)
    return meshes[key]


def train(
    name: str, layout, meshes: dict, steps: int, extra: dict | None = None
) -> tuple[list[float], dict]:
    """``steps`` of ``layout`` on this group: (per-step losses, whole model); ``extra``:
    config sections to replace."""
    import meshtrain

    model = build(name)
    engine, *_ = meshtrain.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config(name, layout, extra),
        topology=mesh(layout, meshes),
    )
    dp, replica = engine.topology.dp_size, engine.topology.dp_rank
    losses = [
        engine.train_batch(iter(micro_batches(step, dp, replica))).item() for step in range(steps)
    ]
    return losses, whole_model(engine)


def refused(name: str, layout, meshes: dict, extra: dict | None = None) -> str:
    """``meshtrain.initialize`` of ``layout`` on real ranks: the first line of the
    ConfigError it raises (AssertionError when it builds)."""
    import meshtrain
    from meshtrain.errors import ConfigError

    model = build(name)
    try:
        meshtrain.initialize(
            model=model,
            model_parameters=model.parameters(),
            config=config(name, layout, extra),
            topology=mesh(layout, meshes),
        )
    except ConfigError as exc:
        return str(exc).splitlines()[0]
    raise AssertionError(f"{name} {layout}: initialized, but LayoutCheck refuses it")


def group(jobs: list[tuple], steps: int) -> list:
    """Run ``jobs`` (``("train" | "refuse", model name, Layout[, config sections])``) on
    this group in order;
    rank 0 returns their results and the references (``{model: reference}``), the others
    None. Each layout is a fresh engine on the same ranks (on the mesh's one ``Topology``,
    given to ``initialize`` as ``topology=``)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    results, meshes = [], {}
    for kind, name, layout, *extra in jobs:
        if kind == "train":
            results.append(train(name, layout, meshes, steps, *extra))
        else:
            results.append(refused(name, layout, meshes, *extra))
    if dist.get_rank() != 0:
        return None
    names = dict.fromkeys(job[1] for job in jobs if job[0] == "train")
    refs = {name: reference(name, steps) for name in names}
    return [results, refs]

"""Stage boundaries that pass a pytree of tensors, against one process.

A ``PipelineModule`` whose layers hand on a dict: the hidden states ``h`` and a second
stream ``streams: (z,)`` (both need gradients), the position ids ``pos`` (int64, indexed by
every block's position embedding), a keep mask ``keep`` (bool) and a padding scale
``scale`` (float, derived from the ids, so it needs no gradient). The same layers run
whole in one process (``PipelineModule.forward``) with gradient accumulation over the
same micro-batches.

* pp 2, ``PipelineRuntime`` driven directly, 1F1B, ZB-H1 (split backward), interleaved
  1F1B and ZBV (two stages per rank, a hand-over at the V's bottom): 4 AdamW steps. The
  same ops run in the same order (a boundary only detaches), so every loss and every
  parameter is **bitwise** the one-process run's (``tolerance.EXACT``). Integer and bool
  leaves arrive unchanged and without ``requires_grad``; the float mask too.
* bytes per step on the boundary, exact (1F1B): per micro-batch the 80-byte header, every
  leaf at its dtype forward, only ``h``'s and ``z``'s gradients backward; the tree's spec
  (``8 L`` bytes) at the channel's first message and again when the sequence length
  changes (step 2), and at that change one dummy of the previous shapes for the receive
  the receiver had posted on a guess. ``pp_p2p`` counts a message on both its ends, so
  each of the two ranks counts every byte of the boundary once.
* pp 2 x dp 2 through ``meshtrain.initialize`` (ZeRO 1 over dp): each replica gets half
  of every micro-batch's rows; losses and the whole model within ``trajectory`` (the dp
  average sums in another order).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.harness import run_ranks
from tests.tolerance import check_trajectory, trajectory

V, D, P, M, ROWS, STEPS = 32, 16, 16, 4, 2, 4
LR = 1e-3
# sequence length per step: the spec is sent at step 0 and again at step 2
LENGTHS = (6, 6, 9, 9)
SCHEDULES = (("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("zbv", 2))


class Embed(nn.Module):
    """Stage 0's first layer: ids -> the dict every later layer passes on."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)

    def forward(self, ids: torch.Tensor) -> dict:
        b, t = ids.shape
        h = self.tok(ids)
        return {
            "h": h,
            "streams": (torch.tanh(h),),
            "pos": torch.arange(t).expand(b, t).contiguous(),
            "keep": ids != 0,
            "scale": (ids != 1).float().unsqueeze(-1),
        }


class Block(nn.Module):
    """Uses every leaf: the int positions index an embedding, the masks gate the update."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.mix, self.pos = nn.Linear(D, D), nn.Linear(D, D), nn.Embedding(P, D)

    def forward(self, s: dict) -> dict:
        (z,) = s["streams"]
        u = torch.tanh(self.lin(s["h"]) + self.pos(s["pos"])) * s["scale"]
        u = torch.where(s["keep"].unsqueeze(-1), u, torch.zeros_like(u))
        return {**s, "h": s["h"] + u, "streams": (z + self.mix(u),)}


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, s: dict) -> torch.Tensor:
        return self.out(self.norm(s["h"] + s["streams"][0]))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


def specs() -> list:
    from meshtrain.pipe import LayerSpec

    return [LayerSpec(Embed), *[LayerSpec(Block) for _ in range(4)], LayerSpec(Head)]


def batches(step: int, part: slice = slice(None)) -> list:
    g = torch.Generator().manual_seed(300 + step)
    out = []
    for _ in range(M):
        ids = torch.randint(0, V, (ROWS, LENGTHS[step]), generator=g)
        out.append((ids[part], torch.roll(ids, -1, 1)[part]))
    return out


class Chain(nn.Module):
    """Layers ``[a, b)`` of a whole ``PipelineModule`` as one stage: the V schedules place
    stages in a V, which a ``PipelineModule``'s own stages (``k % pp``) are not."""

    def __init__(self, pm, a: int, b: int, first: bool, last: bool) -> None:
        super().__init__()
        self.run = nn.ModuleList(pm.layers[str(i)] for i in range(a, b))
        self.first, self.last = first, last

    def forward(self, x, batch):
        x = batch[0] if self.first else x
        for layer in self.run:
            x = layer(x)
        return loss_fn(x, batch[1]) if self.last else x


def _stages(name: str, v: int, topo):
    """(stages of this rank, the module holding their parameters, tied pairs)."""
    from meshtrain.parallel.pipeline.schedules import stage_rank
    from meshtrain.pipe import PipelineModule

    if name not in ("zbv", "dualpipev"):
        pm = PipelineModule(specs(), topology=topo, loss_fn=loss_fn, virtual_stages=v)
        return pm.stages, pm, pm.tied
    pm = PipelineModule(specs(), loss_fn=loss_fn)  # whole, the reference's weights
    bounds, rank = [0, 2, 3, 4, 6], topo.pp_group.rank
    mine = {k for k in range(4) if stage_rank(name, k, topo.pp_size) == rank}
    stages = {k: Chain(pm, bounds[k], bounds[k + 1], k == 0, k == 3) for k in sorted(mine)}
    held = nn.ModuleList(stages.values())
    names = {id(p): n for n, p in pm.named_parameters()}
    return stages, _Named(held, {names[id(p)]: p for p in held.parameters()}), ()


class _Named(nn.Module):
    """The held stages, with their parameters under the whole model's names."""

    def __init__(self, held: nn.Module, named: dict) -> None:
        super().__init__()
        self.held, self.named = held, named

    def named_parameters(self, *args, **kwargs):
        return iter(self.named.items())


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def _reference():
    from meshtrain.pipe import PipelineModule

    torch.set_num_threads(1)
    pm = PipelineModule(specs(), loss_fn=loss_fn)
    opt = _adamw(pm.parameters())
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        per = []
        for x, y in batches(step):
            loss = loss_fn(pm(x), y)
            (loss / M).backward()
            per.append(loss.detach())
        losses.append(torch.stack(per).mean().item())
        opt.step()
    return losses, {n: p.detach().clone() for n, p in pm.named_parameters()}


def _pipeline():
    """pp 2, every schedule: (losses, parameters, bytes per step, the received leaves'
    dtypes and requires_grad, the guess counters) per schedule."""
    from meshtrain.distributed.topology import Topology
    from meshtrain.parallel.pipeline.runtime import PipelineRuntime

    torch.set_num_threads(1)
    topo = Topology(pp=torch.distributed.get_world_size())
    stats = topo.pp_group.stats
    out = {}
    for name, v in SCHEDULES:
        stages, pm, tied = _stages(name, v, topo)
        rt = PipelineRuntime(stages, topo.pp_group, 2 * v, name, tied)
        seen: list = []  # what a later stage's first layer received: leaf dtype, grad flag
        first = min(rt.stages)
        if first > 0:
            layer = rt.stages[first].run[0]

            def record(_m, args, seen=seen):
                leaves = args[0].items()
                seen.append({k: (t.dtype, t.requires_grad) for k, t in leaves if k != "streams"})

            layer.register_forward_pre_hook(record)
        opt = _adamw([p for _n, p in pm.named_parameters()])
        losses, moved = [], []
        for step in range(STEPS):
            opt.zero_grad()
            before = stats.snapshot()
            losses.append(rt.train_step(batches(step)).item())
            diff = stats.diff(stats.snapshot(), before)
            moved.append(sum(n for (op, _g), n in diff.items() if op == "pp_p2p"))
            opt.step()
        params = {n: p.detach().clone() for n, p in pm.named_parameters()}
        counts = (rt.shapes.hits, rt.shapes.misses, rt.shapes.dummies)
        out[name] = (losses, params, moved, seen[:1], counts)
    return out


def _spec_len() -> int:
    """``L`` of the boundary's tree, counted from the format (``pytree``'s docstring): a
    dict head ``[1, n]``; per item the key ``[len, *chars]`` and the value; a tuple head
    ``[2, n]``; a leaf ``[0, dtype, grad, ndim, *shape]``."""
    leaf = {"h": 4 + 3, "pos": 4 + 2, "keep": 4 + 2, "scale": 4 + 3}
    items = {k: 1 + len(k) + n for k, n in leaf.items()}
    items["streams"] = 1 + len("streams") + 2 + (4 + 3)
    return 2 + sum(items.values())


def _boundary_bytes(t: int) -> tuple[int, int]:
    """(forward leaf bytes, backward bytes) of one micro-batch of length ``t``."""
    bt = ROWS * t
    forward = bt * D * 4 * 2 + bt * 8 + bt * 1 + bt * 4  # h, z; pos int64, keep bool, scale
    return forward, bt * D * 4 * 2  # gradients of h and z only


@pytest.fixture(scope="module")
def reference():
    """One process in a group of its own (each rank's intra-op threads: the same matmul
    blocking, so the pipeline can be compared bit for bit)."""
    return run_ranks(_reference, 1)[0]


def test_pytree_boundary_matches_one_process_bitwise(reference):
    ref_losses, ref_params = reference
    per_rank = run_ranks(_pipeline, 2)
    for name, _v in SCHEDULES:
        names = set()
        for rank, got in enumerate(per_rank):
            losses, params, moved, seen, counts = got[name]
            assert losses == ref_losses, (name, rank, losses, ref_losses)
            for n, p in params.items():
                assert torch.equal(p, ref_params[n]), (name, rank, n)
            names |= set(params)
            if rank == 1:  # integer and mask leaves unchanged in dtype, without gradient
                assert seen == [{
                    "h": (torch.float32, True),
                    "pos": (torch.int64, False),
                    "keep": (torch.bool, False),
                    "scale": (torch.float32, False),
                }], (name, seen)  # fmt: skip
            if name != "1f1b":
                continue
            spec, want = 8 * _spec_len(), []
            for step, t in enumerate(LENGTHS):
                fwd, bwd = _boundary_bytes(t)
                total = M * (80 + fwd + bwd)
                if step == 0 or t != LENGTHS[step - 1]:
                    total += spec  # the tree's spec: new channel, new length
                if step > 0 and t != LENGTHS[step - 1]:
                    total += _boundary_bytes(LENGTHS[step - 1])[0]  # the guess's dummy
                want.append(total)
            assert moved == want, (rank, moved, want)
            # guesses: micro-batches 2, 3 of step 0 and all of steps 1 and 3 hit, the
            # first of step 2 misses (one dummy, sent by rank 0), its second has no guess
            if rank == 1:
                assert counts == (2 + 4 + 2 + 4, 1, 0), counts
            else:
                assert counts == (0, 0, 1), counts
        assert names == set(ref_params)


def _engine_dp():
    """pp 2 x dp 2 through ``meshtrain.initialize`` (ZeRO 1), the replica's rows."""
    import meshtrain
    from meshtrain.distributed.topology import Topology
    from meshtrain.pipe import PipelineModule

    torch.set_num_threads(1)
    topo = Topology(pp=2)
    model = PipelineModule(specs(), topology=topo, loss_fn=loss_fn)
    config = {
        "train_micro_batch_size_per_gpu": ROWS // 2,
        "gradient_accumulation_steps": M,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "steps_per_print": 1000,
        "mesh": {"pipeline_parallel_size": 2},
        "zero_optimization": {"stage": 1},
    }
    engine = meshtrain.initialize(model=model, config=config, topology=topo)[0]
    r = engine.topology.dp_rank
    part = slice(r * ROWS // 2, (r + 1) * ROWS // 2)
    losses = [engine.train_batch(iter(batches(s, part))).item() for s in range(STEPS)]
    return losses, engine.module_state_dict()


def test_pytree_boundary_pp2_dp2_matches_one_process(reference):
    ref_losses, ref_params = reference
    bound = trajectory(LR, STEPS)
    for rank, (losses, state) in enumerate(run_ranks(_engine_dp, 4)):
        assert sorted(state) == sorted(ref_params)
        check_trajectory(
            f"pytree pp2 dp2 rank {rank}", (losses, state), (ref_losses, ref_params), bound
        )

"""Every framework a benchmark runs, set up one way, in one place.

``setup(name, model, micro=..., world=..., zero=...)`` wraps ``model`` (already built, same
seed everywhere) for ``name`` and returns a ``Runner``: ``forward(x)`` (returns the loss of
``x`` as input and target), ``backward(loss)``, ``step()``, ``state()`` (model-state bytes
by kind) and ``shutdown()``. The process group is initialised here for the peers and by
``meshtrain.initialize`` for meshtrain. Every framework gets the same AdamW
(``ADAMW``), no gradient clipping (DeepSpeed 0.19.8 clips at 1.0 by default; turned off),
and the same ZeRO knobs (``zero``: reduce/allgather bucket, stage-3 prefetch and
persistence threshold).

To add a framework: add a branch to ``setup`` and its name to ``FRAMEWORKS``. To add a
role (a meshtrain mode and the peers it must beat): add a line to ``ROLES``; the
``python -m benchmarks`` entry then runs it, pairs it and charts it. A role with its own
workload and benchmark script (TP, PP, Trainer, Accelerator) instead names frameworks of
``benchmarks.external.RUNNERS``, which call that script's launcher.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
ADAMW = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
# the reference Decoder's sizes: PEERS.md's 3.7M workload, and the 69.2M decoder of
# issue 12's targets (python -m benchmarks' full mode, the scripts' --model large)
DECODERS = {
    "small": dict(vocab_size=1024, dim=256, n_layers=4, n_heads=4, ffn_dim=688),
    "large": dict(vocab_size=8192, dim=768, n_layers=8, n_heads=12, ffn_dim=2048),
}


def add_model_argument(parser) -> None:
    """``--model small|large``: which of ``DECODERS`` a benchmark script trains."""
    parser.add_argument(
        "--model",
        choices=tuple(DECODERS),
        default="small",
        help="small = PEERS.md's 3.7M decoder, large = the 69.2M one of python -m benchmarks",
    )


MESHTRAIN = ("mt-z0", "mt-z1", "mt-z2", "mt-z3")
FRAMEWORKS = (
    *MESHTRAIN,
    "ddp",
    "torch-zero1",
    "fsdp2-nrf",
    "fsdp2",
    "ds-z0",
    "ds-z1",
    "ds-z2",
    "ds-z3",
)
# role -> (meshtrain framework, its peers); the chart and the pair lines follow this order
ROLES: dict[str, tuple[str, tuple[str, ...]]] = {
    "DP": ("mt-z0", ("ddp", "ds-z0")),
    "ZeRO-1": ("mt-z1", ("torch-zero1", "ds-z1")),
    "ZeRO-2": ("mt-z2", ("fsdp2-nrf", "ds-z2")),
    "ZeRO-3": ("mt-z3", ("fsdp2", "ds-z3")),
    # run by the standalone scripts' own launchers (benchmarks/external.py RUNNERS)
    "TP": ("mt-tp", ("torch-tp",)),
    "PP-GPipe": ("mt-gpipe", ("torch-gpipe",)),
    "PP-1F1B": ("mt-1f1b", ("torch-1f1b",)),
    "Trainer": ("mt-trainer", ("hf-trainer",)),
    "Accelerator": ("mt-accelerate", ("accelerate",)),
}


@dataclass
class Runner:
    forward: Callable
    backward: Callable
    step: Callable
    state: Callable[[], dict[str, int]]
    shutdown: Callable[[], None]
    engine: object = None  # meshtrain's engine (memory_report, comm bytes), else None


def local_bytes(t) -> int:
    """Bytes of ``t`` held by this rank (a DTensor's local shard)."""
    t = getattr(t, "_local_tensor", t)
    return t.numel() * t.element_size()


def state_bytes(params, optimizer) -> dict[str, int]:
    """Parameters, ``.grad``s and optimizer state held by this rank."""
    import torch

    params = list(params)
    opt = sum(
        local_bytes(v)
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": opt,
    }


def _torch_shutdown():
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def setup(name: str, model, *, micro: int, world: int, zero: dict, threads: int = 1) -> Runner:
    """Wrap ``model`` for framework ``name`` (see ``FRAMEWORKS``)."""
    import torch
    import torch.distributed as dist

    if name in MESHTRAIN:
        import meshtrain

        config = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(BETAS)}},
            # overlap_param_gather: the all-gather after a step runs into the next forward
            "zero_optimization": {"stage": int(name[-1]), "overlap_param_gather": True, **zero},
            "steps_per_print": 10**9,
        }
        engine, _, _, _ = meshtrain.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )

        def state():
            m = engine.memory_report().measured
            return {"params": m.params, "grads": m.grads, "optimizer": m.optimizer}

        return Runner(
            lambda x: engine(x, x),
            engine.backward,
            engine.step,
            state,
            meshtrain.shutdown_distributed,
            engine,
        )

    if name in ("ddp", "torch-zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        dist.init_process_group("gloo")
        ddp = DDP(model)
        if name == "ddp":
            opt = torch.optim.AdamW(ddp.parameters(), **ADAMW)
            inner = opt
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(
                ddp.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW
            )
            inner = opt.optim  # holds only this rank's partition

        def step():
            opt.step()
            opt.zero_grad(set_to_none=True)

        return Runner(
            lambda x: ddp(x, x),
            lambda loss: loss.backward(),
            step,
            lambda: state_bytes(ddp.parameters(), inner),
            _torch_shutdown,
        )

    if name in ("fsdp2", "fsdp2-nrf"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (world,))
        reshard = name == "fsdp2"
        for block in model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)

        def step():
            opt.step()
            opt.zero_grad(set_to_none=True)

        return Runner(
            lambda x: model(x, x),
            lambda loss: loss.backward(),
            step,
            lambda: state_bytes(model.parameters(), opt),
            _torch_shutdown,
        )

    if name.startswith("ds-z"):
        import deepspeed

        stage = int(name[-1])
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        ds_engine, ds_opt, _, _ = deepspeed.initialize(
            model=model,
            optimizer=opt,
            config={
                "train_micro_batch_size_per_gpu": micro,
                "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": stage, **(zero if stage else {})},
                "gradient_clipping": 0.0,  # DeepSpeed 0.19.8 defaults to 1.0
                "steps_per_print": 10**9,
                "wall_clock_breakdown": False,
            },
        )
        torch.set_num_threads(threads)  # DeepSpeed's CPU accelerator may change it

        def state():
            # module parameters (ZeRO-3: their ds_tensor shards), .grads, the wrapped AdamW's
            # state and its parameters when they are separate fp32 copies ("master")
            inner = getattr(ds_opt, "optimizer", ds_opt)
            params = list(ds_engine.module.parameters())
            out = state_bytes(params, inner)
            if stage == 3:
                out["params"] = sum(local_bytes(p.ds_tensor) for p in params)
            mine = {p.untyped_storage().data_ptr() for p in params}
            out["master"] = sum(
                local_bytes(q)
                for g in inner.param_groups
                for q in g["params"]
                if q.untyped_storage().data_ptr() not in mine
            )
            return out

        return Runner(
            lambda x: ds_engine(x, x),
            ds_engine.backward,
            ds_engine.step,
            state,
            _torch_shutdown,
        )

    raise SystemExit(f"unknown framework {name!r}; known: {', '.join(FRAMEWORKS)}")


# the MoE layer's workload (bench_moe.py): Mixtral-style SwiGLU experts, top-2, dropless
MOE = dict(hidden=256, ffn=512, experts=8, top_k=2)
MOE_FRAMEWORKS = ("mt-moe", "ds-moe")


def moe_setup(name: str, *, ep: int, micro: int, seed: int, threads: int = 1) -> Runner:
    """One MoE layer (``MOE``) at expert parallelism ``ep``, trained through its framework's
    engine at ZeRO-0 with ``ADAMW``; ``forward(x)`` returns ``mean(layer(x) ** 2)``.

    ``mt-moe``: meshtrain's MoE layer (``meshtrain.models.moe.MoE``, Mixtral's routing:
    softmax, top-k, renormalised) under ``meshtrain.initialize`` with
    ``mesh.expert_parallel_size = ep`` (experts sharded by ``parallelize`` step 3, dropless
    all-to-all dispatch). ``ds-moe``: ``deepspeed.moe.layer.MoE`` with the same
    SwiGLU expert, top-2, ``drop_tokens=False`` (dropless: capacity = the largest expert's
    load), no random token selection and no sampled second expert (both change only which
    tokens are kept or routed, not the work), under ``deepspeed.initialize``."""
    import torch
    from torch import nn

    h, f, e, k = MOE["hidden"], MOE["ffn"], MOE["experts"], MOE["top_k"]
    torch.manual_seed(seed)
    if name == "mt-moe":
        import meshtrain
        from meshtrain.models.moe import MoE, MoEConfig

        class Layer(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.moe = MoE(h, f, MoEConfig(n_experts=e, top_k=k))  # softmax, top-k, renorm
                with torch.no_grad():
                    for p in self.moe.parameters():
                        p.normal_(0.0, 0.02)

            def forward(self, x):
                return self.moe(x).pow(2).mean()

        model = Layer()
        engine, _, _, _ = meshtrain.initialize(
            model=model,
            model_parameters=model.parameters(),
            config={
                "train_micro_batch_size_per_gpu": micro,
                "gradient_clipping": 0.0,
                "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(BETAS)}},
                "zero_optimization": {"stage": 0},
                "mesh": {"expert_parallel_size": ep},
                "steps_per_print": 10**9,
            },
        )

        def state():
            m = engine.memory_report().measured
            return {"params": m.params, "grads": m.grads, "optimizer": m.optimizer}

        return Runner(
            engine, engine.backward, engine.step, state, meshtrain.shutdown_distributed, engine
        )

    if name == "ds-moe":
        import deepspeed
        from deepspeed.moe.layer import MoE

        class SwiGLU(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.gate = nn.Linear(h, f, bias=False)
                self.up = nn.Linear(h, f, bias=False)
                self.down = nn.Linear(f, h, bias=False)

            def forward(self, x):
                return self.down(nn.functional.silu(self.gate(x)) * self.up(x))

        class Layer(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.moe = MoE(
                    h,
                    SwiGLU(),
                    num_experts=e,
                    ep_size=ep,
                    k=k,
                    drop_tokens=False,
                    use_rts=False,
                    top2_2nd_expert_sampling=False,
                )

            def forward(self, x):
                out, _aux, _counts = self.moe(x)
                return out.pow(2).mean()

        deepspeed.init_distributed(dist_backend="gloo")
        model = Layer()
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        ds_engine, ds_opt, _, _ = deepspeed.initialize(
            model=model,
            optimizer=opt,
            config={
                "train_micro_batch_size_per_gpu": micro,
                "zero_optimization": {"stage": 0},
                "gradient_clipping": 0.0,
                "steps_per_print": 10**9,
            },
        )
        torch.set_num_threads(threads)
        inner = getattr(ds_opt, "optimizer", ds_opt)
        return Runner(
            ds_engine,
            ds_engine.backward,
            ds_engine.step,
            lambda: state_bytes(ds_engine.module.parameters(), inner),
            _torch_shutdown,
        )

    raise SystemExit(f"unknown MoE framework {name!r}; known: {', '.join(MOE_FRAMEWORKS)}")

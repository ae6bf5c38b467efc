"""One candidate layout: every knob the planner turns, and the config that runs it.

A ``Layout`` is the planner's unit: mesh sizes (pp x dp x cp x tp, ep carved out of
dp x cp), the ZeRO stage and offload, sequence parallelism, the pipeline schedule, the
context-parallel method, the micro-batch, activation checkpointing, the chunked loss and packed rows. ``config`` writes
it in meshtrain's config keys (DeepSpeed's where they exist), the dict
``meshtrain.initialize(config=...)`` and ``meshtrain train --config`` take as is, so the
layout the planner scored is the layout that runs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    """A parallel layout for ``world = pp * dp * cp * tp`` devices."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    cp_method: str = "ring"
    micro_batch: int = 1
    grad_accum: int = 1  # = micro-batches per step under a pipeline
    checkpointing: bool = False
    loss_chunk: int = 0  # loss.chunked's chunk_size (tokens per head-and-loss chunk); 0: off
    packed: bool = False  # rows of several documents, kept apart by masks (docs/packing.md)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    def but(self, **changes: Any) -> Layout:
        """This layout with some fields changed."""
        return replace(self, **changes)

    def label(self) -> str:
        """A short name: only what differs from one plain process."""
        parts = [f"dp{self.dp}"]
        if self.stage:
            parts.append(f"z{self.stage}")
        if self.offload_optimizer or self.offload_param:
            parts.append("offload:opt" + ("+param" if self.offload_param else ""))
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("sp" if self.sequence_parallel else ""))
        if self.pp > 1:
            v = f"v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"pp{self.pp}:{self.schedule}{v}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}:{'a2a' if self.cp_method == 'all_to_all' else 'ring'}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"mb{self.micro_batch}x{self.grad_accum}")
        if self.checkpointing:
            parts.append("ac")
        if self.loss_chunk:
            parts.append(f"chunked-loss{self.loss_chunk}")
        if self.packed:
            parts.append("packed")
        return " ".join(parts)

    def config(self, precision: str = "bf16", optimizer: str = "AdamW") -> dict[str, Any]:
        """The meshtrain config of this layout (module docstring)."""
        zero: dict[str, Any] = {"stage": self.stage}
        if self.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu"}
        if self.offload_param:
            zero["offload_param"] = {"device": "cpu"}
        out: dict[str, Any] = {
            "train_batch_size": self.global_batch,
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.grad_accum,
            "optimizer": {"type": optimizer, "params": {"lr": 3e-4}},
            "zero_optimization": zero,
            "mesh": {
                "pipeline_parallel_size": self.pp,
                "tensor_parallel_size": self.tp,
                "context_parallel_size": self.cp,
                "expert_parallel_size": self.ep,
            },
        }
        if self.cp > 1:
            # load_config checks train_batch_size against world / (pp x tp) = dp x cp
            # replicas while the engine counts dp (cp ranks share rows): written, it is
            # refused by one of them, so it is left to be derived (micro x accumulation x dp)
            del out["train_batch_size"]
        if precision in ("bf16", "fp16"):
            out[precision] = {"enabled": True}
        if self.tp > 1:
            out["tensor_parallel"] = {"sequence_parallel": self.sequence_parallel}
        if self.pp > 1:
            out["pipeline"] = {"schedule": self.schedule, "virtual_stages": self.virtual_stages}
        if self.cp > 1:
            out["context_parallel"] = {"method": self.cp_method}
        if self.checkpointing:
            out["activation_checkpointing"] = {"enabled": True}
        if self.loss_chunk:
            out["loss"] = {"chunked": True, "chunk_size": self.loss_chunk}
        # packed rows are the batches' shape (position_ids restarting per document), not an
        # engine key: meshtrain train's data.packing or a packing collator makes them
        return out

    @classmethod
    def from_config(cls, config, world: int) -> Layout:
        """The layout a validated ``Config`` describes on ``world`` devices."""
        m, z = config.mesh, config.zero_optimization
        pp, tp, cp = m.pipeline_parallel_size, m.tensor_parallel_size, m.context_parallel_size
        dp = max(1, world // (pp * tp * cp))
        resolved = config.resolve_batch_sizes(dp)
        return cls(
            dp=dp,
            tp=tp,
            pp=pp,
            cp=cp,
            ep=m.expert_parallel_size,
            stage=int(z.stage),
            offload_optimizer=z.offload_optimizer is not None
            and z.offload_optimizer.device == "cpu",
            offload_param=z.offload_param is not None and z.offload_param.device == "cpu",
            sequence_parallel=bool(config.tensor_parallel.sequence_parallel) and tp > 1,
            schedule=config.pipeline.schedule,
            virtual_stages=config.pipeline.virtual_stages,
            cp_method=config.context_parallel.method,
            micro_batch=int(resolved.train_micro_batch_size_per_gpu),
            grad_accum=int(resolved.gradient_accumulation_steps),
            checkpointing=bool(config.activation_checkpointing.enabled),
            loss_chunk=int(config.loss.chunk_size) if config.loss.chunked else 0,
        )

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

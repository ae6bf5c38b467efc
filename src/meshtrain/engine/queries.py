"""The Engine's queries, under DeepSpeed's names and meanings (``engine.get_lr()``,
``engine.train_batch_size()``, ``engine.global_rank``, ...): read-only views of the state
that ``meshtrain.engine.engine.Engine`` keeps. A mixin so that engine.py holds the step."""

from __future__ import annotations


class EngineQueries:
    def get_lr(self) -> list[float]:
        """The current learning rate of each optimizer param group."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-batch on one data-parallel rank."""
        return self.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.gas

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks (micro x accumulation x dp)."""
        return self.micro_batch_size * self.gas * self.topology.dp_size

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage (0-3) the engine runs."""
        return self.zero_stage

    def fp16_enabled(self) -> bool:
        """True when the model runs in float16 with loss scaling."""
        return self.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        """True when the model runs in bfloat16."""
        return self.config.precision == "bf16"

    @property
    def global_rank(self) -> int:
        """This process's rank in the world."""
        return self.topology.rank

    @property
    def world_size(self) -> int:
        """Number of processes in the world (``dp_world_size`` counts data-parallel ranks)."""
        return self.topology.world_size

    @property
    def dp_world_size(self) -> int:
        """Number of data-parallel ranks (equal to ``world_size`` without TP/PP)."""
        return self.topology.dp_size

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (``LOCAL_RANK`` / ``SLURM_LOCALID``; 0 alone)."""
        from meshtrain.distributed.env import read_env

        return read_env().local_rank

    def get_global_grad_norm(self) -> float | None:
        """Global gradient norm of the last step before clipping (None if it overflowed)."""
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step changed the parameters (False after a skip)."""
        return self._step_applied

    @property
    def last_step_skipped(self) -> bool:
        return not self._step_applied

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def last_step_comm_bytes(self) -> dict[str, int]:
        """Bytes the last optimizer step recorded, by op kind, plus ``"total"``."""
        by_op: dict[str, int] = {}
        for (op, _group), n in self._step_comm.items():
            by_op[op] = by_op.get(op, 0) + n
        by_op["total"] = sum(by_op.values())
        return by_op

    def last_step_comm_by_group(self) -> dict[tuple[str, str], int]:
        """Bytes the last optimizer step recorded, by (op kind or label, group name)."""
        return dict(self._step_comm)

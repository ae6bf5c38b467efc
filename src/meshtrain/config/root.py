"""The top-level ``Config``: every section, cross-section rules, and the resolution methods.

Which batch values were *derived* (not written by the user) is remembered in a private
attribute, so ``resolve_batch_sizes`` can re-derive them for the real mesh; it is
bookkeeping, not part of the value (``==`` compares the fields only).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, PrivateAttr, ValidationError, model_validator

from meshtrain.config._errors import show, translate, union_members
from meshtrain.config._types import (
    AUTO,
    Auto,
    Bool,
    NonNegFloat,
    PosFloat,
    PosInt,
    Section,
    canonical_choice,
    label_paths,
)
from meshtrain.config.optimizer import (
    OptimizerConfig,
    SchedulerConfig,
)
from meshtrain.config.resolve import (
    BATCH_KEYS,
    auto_default_values,
    check_path,
    derive_batch_sizes,
)
from meshtrain.config.sections import (
    ActivationCheckpointingConfig,
    AmpConfig,
    BF16Config,
    CheckpointConfig,
    CompileConfig,
    ContextParallelConfig,
    DistributedConfig,
    FP8Config,
    FP16Config,
    LossConfig,
    MeshConfig,
    PipelineConfig,
    TensorBoardConfig,
    TensorParallelConfig,
    ZeroConfig,
)
from meshtrain.errors import ConfigError

Ignored = dict[str, Any] | None


class Config(Section):
    """A validated meshtrain config: DeepSpeed's keys plus meshtrain's own sections."""

    train_batch_size: PosInt | Auto | None = None
    """Global batch in samples per optimizer step = micro batch * gradient_accumulation_steps * data-parallel size. Derived when absent."""
    train_micro_batch_size_per_gpu: PosInt | Auto | None = None
    """Samples per forward/backward on one data-parallel rank. Derived when absent."""
    gradient_accumulation_steps: PosInt | Auto | None = None
    """Micro batches accumulated per optimizer step. Derived when absent."""
    gradient_clipping: NonNegFloat | Auto = 0.0
    """Clip the global gradient L2 norm (over all shards) to this value; 0 disables clipping."""
    steps_per_print: PosInt = 10
    """Log progress every this many optimizer steps."""
    wall_clock_breakdown: Bool = False
    """Add the time spent in forward, backward and step to each step line and to the step's facts (engine.log.last); on CUDA each phase is synchronised."""
    prescale_gradients: Bool = False
    """Divide gradients by the data-parallel size before the reduction instead of after (keeps fp16 sums in range); overrides gradient_predivide_factor."""
    gradient_predivide_factor: PosFloat = 1.0
    """Divide gradients by this factor before the reduction and by dp / factor after it."""
    communication_data_type: canonical_choice(("fp32", "fp16", "bf16")) | None = None
    """Dtype of gradient reductions (e.g. "fp32" sums bf16 gradients in fp32; bytes moved follow this dtype); null = the gradients' own dtype."""
    zero_allow_untested_optimizer: Bool = False
    """Accepted and ignored: meshtrain's ZeRO works with any torch optimizer."""
    optimizer: OptimizerConfig | None = None
    """The optimizer to build; null = pass your own optimizer to initialize()."""
    scheduler: SchedulerConfig | None = None
    """The learning-rate schedule; null = constant learning rate (or pass your own)."""
    fp16: FP16Config = FP16Config()
    """float16 mixed precision and loss scaling."""
    bf16: BF16Config = BF16Config()
    """bfloat16 mixed precision."""
    amp: AmpConfig = AmpConfig()
    """apex AMP (accepted only as disabled)."""
    zero_optimization: ZeroConfig = ZeroConfig()
    """ZeRO stage, buckets and offload."""
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()
    """Activation (gradient) checkpointing."""
    tensorboard: TensorBoardConfig = TensorBoardConfig()
    """TensorBoard logging."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpoint saving and retention."""
    compile: CompileConfig = CompileConfig()
    """torch.compile."""
    fp8: FP8Config = FP8Config()
    """meshtrain: float8 linear layers (torchao, tensorwise scaling)."""
    loss: LossConfig = LossConfig()
    """meshtrain: chunked cross-entropy for causal LMs."""
    mesh: MeshConfig = MeshConfig()
    """meshtrain: pipeline, data, context and tensor parallel sizes."""
    context_parallel: ContextParallelConfig = ContextParallelConfig()
    """meshtrain: the context-parallel attention method (ring or all_to_all)."""
    pipeline: PipelineConfig = PipelineConfig()
    """meshtrain: pipeline schedule and stage balancing."""
    tensor_parallel: TensorParallelConfig = TensorParallelConfig()
    """Tensor parallelism: DeepSpeed's autotp_size alias, sequence parallelism, a plan for your own model."""
    distributed: DistributedConfig = DistributedConfig()
    """meshtrain: collective timeout and backend."""
    memory_breakdown: Bool = False
    """Accepted and ignored (DeepSpeed memory logging)."""
    dump_state: Bool = False
    """Accepted and ignored (DeepSpeed state dump)."""
    sparse_gradients: Bool = False
    """Accepted and ignored (DeepSpeed sparse embedding gradients)."""
    fp32_allreduce: Bool = False
    """Accepted and ignored; use communication_data_type "fp32"."""
    disable_allgather: Bool = False
    """Accepted and ignored (DeepSpeed)."""
    zero_force_ds_cpu_optimizer: Bool = True
    """Accepted and ignored (DeepSpeed CPU-Adam enforcement)."""
    flops_profiler: Ignored = None
    """Accepted and ignored (DeepSpeed flops profiler section)."""
    wandb: Ignored = None
    """Accepted and ignored (DeepSpeed Weights & Biases monitor section)."""
    csv_monitor: Ignored = None
    """Accepted and ignored (DeepSpeed CSV monitor section)."""
    comms_logger: Ignored = None
    """Accepted and ignored (DeepSpeed communication logger section)."""
    aio: Ignored = None
    """Accepted and ignored (DeepSpeed NVMe async-I/O section)."""
    data_types: Ignored = None
    """Accepted and ignored (DeepSpeed gradient-accumulation dtype section)."""
    sparse_attention: Ignored = None
    """Accepted and ignored (DeepSpeed sparse attention kernels)."""
    elasticity: Ignored = None
    """Accepted and ignored (DeepSpeed elastic batch sizes; meshtrain restarts via torchrun)."""
    autotuning: Ignored = None
    """Accepted and ignored (DeepSpeed autotuner section)."""

    _derived: frozenset[str] = PrivateAttr(default=frozenset())

    @model_validator(mode="after")
    def _coherent(self) -> Config:
        label_paths(self)  # first: an assignment below that fails names its section
        if self.fp16.enabled is True and self.bf16.enabled is True:
            raise ConfigError("fp16.enabled and bf16.enabled are both true; enable at most one")
        if self.amp.enabled is True:
            raise ConfigError(
                "amp.enabled: true is not supported (meshtrain does not use NVIDIA apex); "
                'use "fp16": {"enabled": true} or "bf16": {"enabled": true} instead'
            )
        tp = self.tensor_parallel.autotp_size
        if tp:
            given = "tensor_parallel_size" in self.mesh.model_fields_set
            if given and self.mesh.tensor_parallel_size != tp:
                raise ConfigError(
                    f"tensor_parallel.autotp_size {tp} != mesh.tensor_parallel_size "
                    f"{self.mesh.tensor_parallel_size}; they are the same setting, give one"
                )
            self.mesh.tensor_parallel_size = tp
        z = self.zero_optimization
        if z.offload_param is not None and z.offload_param.device != "none" and z.stage != 3:
            raise ConfigError(
                f"zero_optimization.offload_param: parameter offload needs stage 3 (stage is "
                f"{z.stage}); set stage to 3 or remove offload_param"
            )
        if (
            z.offload_optimizer is not None
            and z.offload_optimizer.device != "none"
            and z.stage == 0
        ):
            raise ConfigError(
                "zero_optimization.offload_optimizer: optimizer offload needs ZeRO stage 1, 2 "
                "or 3 (stage is 0)"
            )
        return self

    def __eq__(self, other: object) -> bool:
        # Which batch values were derived is bookkeeping, not part of the config's value.
        return type(other) is type(self) and self.model_dump() == other.model_dump()

    __hash__ = None  # type: ignore[assignment]

    # ------------------------------------------------------------------ views

    @property
    def precision(self) -> str:
        """ "bf16", "fp16" or "fp32" ("auto" that nobody filled counts as disabled)."""
        if self.bf16.enabled is True:
            return "bf16"
        if self.fp16.enabled is True:
            return "fp16"
        return "fp32"

    def to_dict(self, *, derived: bool = True) -> dict[str, Any]:
        """JSON-serialisable dict of what the user wrote plus resolved values.

        ``derived=False`` leaves out the batch sizes meshtrain derived (rather than the user
        wrote), so the dict reloads under a different world size (e.g. in checkpoint metadata).
        """
        exclude = set() if derived else set(self._derived)
        return self.model_dump(mode="json", exclude_unset=True, exclude=exclude)

    def auto_paths(self) -> list[str]:
        """Dotted paths whose value is still the "auto" placeholder (not e.g. backend "auto")."""
        found: list[str] = []

        def walk(node: BaseModel, path: str) -> None:
            for name, field in type(node).model_fields.items():
                value = getattr(node, name)
                where = f"{path}.{name}" if path else name
                if isinstance(value, BaseModel):
                    walk(value, where)
                elif value == AUTO and Auto in union_members(field.annotation):
                    found.append(where)

        walk(self, "")
        return found

    # ------------------------------------------------------------------ resolution

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Validate a plain dict; errors become ConfigError naming the path."""
        if not isinstance(data, dict):
            raise ConfigError(f"config: {show(data)} is not allowed; expected a mapping")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise translate(exc, cls, raw=data) from None

    def _rebuild(self, data: dict[str, Any], derived: frozenset[str]) -> Config:
        new = type(self).from_dict(data)
        new._derived = derived
        return new

    def resolve_auto(self, values: dict[str, Any]) -> Config:
        """Fill "auto" values: ``{"optimizer.params.lr": 1e-3, ...}`` (dotted paths).

        Only values that are "auto" are replaced; a number the user wrote wins. A path that is
        not a config key raises ConfigError (with a suggestion); a path whose section this
        config does not have is skipped, like the transformers integration does.
        """
        data = self.to_dict()
        autos = set(self.auto_paths())
        for path, value in values.items():
            check_path(Config, path)
            if path not in autos:
                continue
            node, *keys = data, *path.split(".")
            for key in keys[:-1]:
                node = node[key]
            node[keys[-1]] = value
        return self._rebuild(data, self._derived)

    def resolve_auto_defaults(self, *, hidden_size: int | None = None) -> Config:
        """Fill every "auto" nobody filled with the documented default (see AUTO_DEFAULTS).

        ``hidden_size`` (the model's) sizes the ZeRO buckets as the transformers integration
        does. Batch-size "auto" values become unset, so ``resolve_batch_sizes`` derives them.
        Raises ConfigError for scheduler.params.total_num_steps, which has no default.
        """
        defaults = auto_default_values(self, hidden_size)
        resolved = self.resolve_auto(defaults)
        data = resolved.to_dict()
        for key in BATCH_KEYS:  # unfilled batch "auto" -> unset, then derived
            if data.get(key) is None:
                data.pop(key, None)
        resolved = self._rebuild(data, self._derived)
        if resolved.auto_paths():
            raise ConfigError(
                f'{resolved.auto_paths()[0]}: "auto" has no default; write a number or fill it '
                "with resolve_auto({...}) (the Trainer fills it from the number of training steps)"
            )
        return resolved

    def resolve_batch_sizes(self, dp_size: int) -> Config:
        """Derive the batch triple for ``dp_size`` data-parallel ranks (see module docstring).

        Values written by the user are kept and checked; values derived earlier (for another
        data-parallel size) are derived again. Raises ConfigError on an inconsistent or
        indivisible triple, or while any of the three is still "auto".
        """
        if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
            raise ConfigError(
                f"data-parallel size {show(dp_size)} is not allowed; use an integer >= 1"
            )
        given = {
            k: getattr(self, k)
            for k in BATCH_KEYS
            if getattr(self, k) is not None and k not in self._derived
        }
        autos = [k for k, v in given.items() if v == AUTO]
        if autos:
            raise ConfigError(
                f'{autos[0]}: "auto" must be filled before batch sizes are resolved; call '
                "resolve_auto({...}) or resolve_auto_defaults() first"
            )
        triple = derive_batch_sizes(dp_size, **given)
        data = {**self.to_dict(), **dict(zip(BATCH_KEYS, triple, strict=True))}
        return self._rebuild(data, frozenset(k for k in BATCH_KEYS if k not in given))

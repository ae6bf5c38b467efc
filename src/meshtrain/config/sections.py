"""The config sections, one pydantic model each, with DeepSpeed's key names and defaults.

Every field's attribute docstring is its documentation (``docs/config.md`` is generated from
them). Fields that DeepSpeed accepts but meshtrain does not act on say so in their first words
("Accepted and ignored"), so a copied DeepSpeed config loads unchanged.
"""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from meshtrain.config._errors import did_you_mean, show
from meshtrain.config._types import (
    Auto,
    Bool,
    NonNegFloat,
    NonNegInt,
    PosFloat,
    PosInt,
    Section,
    Str,
    canonical_choice,
    int_choice,
)
from meshtrain.errors import ConfigError

# --------------------------------------------------------------------------- precision


class FP16Config(Section):
    """``fp16``: float16 mixed precision with fp32 master weights and dynamic loss scaling."""

    enabled: Bool | Auto = False
    """Train in float16 mixed precision (fp32 master weights, scaled loss). "auto" is filled by the Trainer; unfilled it means false."""
    auto_cast: Bool = False
    """Accepted and ignored: meshtrain always casts floating-point inputs of the model's forward to the model's dtype (float16 here)."""
    loss_scale: NonNegFloat = 0.0
    """Static loss scale (a multiplier); 0 selects dynamic loss scaling."""
    initial_scale_power: NonNegInt = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: PosInt = 1000
    """Consecutive non-overflowing optimizer steps before the dynamic scale is doubled."""
    hysteresis: PosInt = 2
    """Overflowing steps tolerated before the dynamic scale is halved (delayed shift)."""
    consecutive_hysteresis: Bool = False
    """Refill the hysteresis budget on every step that does not overflow (instead of only after a raise)."""
    min_loss_scale: PosFloat = 1.0
    """The dynamic loss scale is never lowered below this value."""
    fp16_master_weights_and_grads: Bool = False
    """Accepted and ignored: meshtrain always keeps fp32 master weights and gradients."""
    raise_error_at_min_scale: Bool = True
    """An overflow that would lower the dynamic scale below min_loss_scale stops the run at once with TrainingError, as DeepSpeed's DynamicLossScaler (raise_error_at_min_scale, true in DeepSpeed's engines). False: skip such steps (see max_overflow_steps_at_min)."""
    max_overflow_steps_at_min: PosInt = 10
    """meshtrain: with raise_error_at_min_scale false (and in fp32/bf16, for non-finite gradients), consecutive overflowing steps with the scale at min_loss_scale before training raises TrainingError (instead of skipping steps forever)."""


class BF16Config(Section):
    """``bf16``: bfloat16 mixed precision (no loss scaling needed)."""

    enabled: Bool | Auto = False
    """Train in bfloat16 mixed precision with fp32 master weights. "auto" is filled by the Trainer; unfilled it means false."""


class AmpConfig(Section):
    """``amp``: NVIDIA apex AMP. Accepted so transformers-style configs load; only "auto"/false work."""

    enabled: Bool | Auto = False
    """Must be false or "auto" (meaning false): meshtrain does not use apex; use fp16 or bf16 instead."""
    opt_level: Str | Auto = "O1"
    """Accepted and ignored: apex's optimization level."""


# --------------------------------------------------------------------------- ZeRO


class OffloadOptimizerConfig(Section):
    """``zero_optimization.offload_optimizer``: keep optimizer states (and the step) on CPU."""

    device: canonical_choice(("none", "cpu")) = "none"
    """Where optimizer states live: "cpu" offloads them and runs the optimizer step on CPU; "none" keeps them on the accelerator. (NVMe is not supported.)"""
    pin_memory: Bool = False
    """Accepted and ignored: offloaded fp32 masters and optimizer states are always page-locked when a CUDA device is present (faster copies), and plain host memory otherwise."""


class OffloadParamConfig(Section):
    """``zero_optimization.offload_param``: keep ZeRO-3 parameter shards on CPU."""

    device: canonical_choice(("none", "cpu")) = "none"
    """Where parameter shards live between uses: "cpu" or "none" (stage 3 only; NVMe is not supported)."""
    pin_memory: Bool = False
    """Accepted and ignored: offloaded parameter shards live in plain host memory."""


class ZeroConfig(Section):
    """``zero_optimization``: ZeRO sharding of optimizer states, gradients and parameters."""

    stage: int_choice(0, 1, 2, 3) = 0
    """0: plain data parallelism; 1: shard optimizer states; 2: + gradients; 3: + parameters."""
    allgather_partitions: Bool = True
    """Accepted and ignored: updated parameter shards are always gathered with one all-gather per bucket (DeepSpeed's false means a series of broadcasts)."""
    allgather_bucket_size: NonNegInt = 500_000_000
    """Accepted and ignored: updated parameters are all-gathered bucket by bucket, in the buckets of reduce_bucket_size."""
    overlap_comm: Bool = True
    """Launch each gradient bucket's reduction as soon as its gradients are ready, overlapping backward (true); false launches every bucket after backward ends. meshtrain's default is true at every stage (DeepSpeed's is false below stage 3)."""
    overlap_param_gather: Bool = False
    """Stages 1-2 (Megatron's name): leave the parameter all-gather after a step running into the next forward, each bucket waited for just before the module owning its parameters runs. Bit-identical results. Off by default because a parameter read directly (p.data, p.norm()) between step() and the next forward may then be mid-transfer; state_dict(), module_state_dict(), gathered_parameters(), checkpoints and forward wait."""
    reduce_scatter: Bool = True
    """Accepted and ignored: stages 1-3 always reduce-scatter gradients (each rank needs only its shard) and stage 0 always all-reduces."""
    reduce_bucket_size: NonNegInt | Auto = 500_000_000
    """Elements per gradient bucket reduced at a time (also the data-parallel all-reduce bucket size). "auto": hidden_size**2."""
    contiguous_gradients: Bool = True
    """Accepted and ignored: gradients always live in contiguous flat buffers (stages 0-1) or are packed bucket by bucket before their reduce-scatter (stages 2-3)."""
    offload_optimizer: OffloadOptimizerConfig | None = None
    """CPU offload of optimizer states (stages 1-3)."""
    offload_param: OffloadParamConfig | None = None
    """CPU offload of parameters (stage 3 only)."""
    sub_group_size: NonNegInt = 1_000_000_000
    """Accepted and ignored: elements per optimizer-step tile (ZeRO-Infinity)."""
    stage3_prefetch_bucket_size: NonNegInt | Auto = 50_000_000
    """Stage 3: parameter elements gathered ahead of use. "auto": 0.9 * hidden_size**2."""
    stage3_module_classes: list[Str] = []
    """meshtrain, stage 3: class names whose instances are gathered as one unit; empty = each block of the model's outermost ModuleList/Sequential and each other child on the way."""
    stage3_param_persistence_threshold: NonNegInt | Auto = 100_000
    """Stage 3: parameters with fewer elements stay unsharded (saves latency-bound collectives). "auto": 10 * hidden_size."""
    stage3_max_live_parameters: NonNegInt | Auto = 1_000_000_000
    """Accepted and ignored: meshtrain frees each stage-3 unit right after its forward and after its gradients are reduced; what is gathered ahead is bounded by stage3_prefetch_bucket_size. "auto": 1e9."""
    stage3_max_reuse_distance: NonNegInt | Auto = 1_000_000_000
    """Accepted and ignored: a stage-3 unit is gathered again for each use (see stage3_max_live_parameters). "auto": 1e9."""
    stage3_gather_16bit_weights_on_model_save: Bool | Auto = False
    """Accepted and ignored: engine.save_16bit_model(), engine.module_state_dict(), `meshtrain consolidate` and every checkpoint give whole weights under any stage. "auto": false."""
    round_robin_gradients: Bool = False
    """Accepted and ignored (DeepSpeed CPU-offload copy ordering)."""
    load_from_fp32_weights: Bool = True
    """Accepted and ignored: meshtrain always restores fp32 master weights from the checkpoint."""
    ignore_unused_parameters: Bool = True
    """Trainable parameters that get no gradient in a synchronising backward count as zero gradients (true); false raises TrainingError naming them (a check that costs a set insertion per parameter per backward)."""
    memory_efficient_linear: Bool = True
    """Accepted and ignored (DeepSpeed stage-3 linear implementation)."""


# --------------------------------------------------------------------------- the rest


class ActivationCheckpointingConfig(Section):
    """``activation_checkpointing``: recompute activations in backward instead of storing them."""

    enabled: Bool = False
    """meshtrain: wrap modules in activation checkpointing (DeepSpeed enables it from model code; meshtrain from this switch)."""
    module_classes: list[Str] = []
    """meshtrain: class names whose instances are checkpointed; empty = the reference model's blocks, else each child of the model's first nn.ModuleList."""
    partition_activations: Bool = False
    """Accepted and ignored (DeepSpeed: shard checkpoints across tensor-parallel ranks)."""
    cpu_checkpointing: Bool = False
    """Accepted and ignored (DeepSpeed: offload checkpoints to CPU)."""
    contiguous_memory_optimization: Bool = False
    """Accepted and ignored (DeepSpeed: copy checkpoints into one buffer)."""
    number_checkpoints: PosInt | None = None
    """Accepted and ignored (DeepSpeed: buffer count for contiguous_memory_optimization)."""
    synchronize_checkpoint_boundary: Bool = False
    """Accepted and ignored (DeepSpeed: device synchronize at each checkpoint boundary)."""
    profile: Bool = False
    """Accepted and ignored (DeepSpeed: time each checkpointed function)."""


class TensorBoardConfig(Section):
    """``tensorboard``: write training scalars (loss, learning rate, loss scale) as TensorBoard events."""

    enabled: Bool = False
    """Write TensorBoard event files."""
    output_path: Str = ""
    """Folder for the event files ("" = the current directory)."""
    job_name: Str = "meshtrain"
    """Sub-folder of output_path for this run."""


class ParallelWriteConfig(Section):
    """``checkpoint.parallel_write``."""

    pipeline_stage: Bool = False
    """Accepted and ignored: every meshtrain rank always writes its own shard in parallel."""


class CheckpointConfig(Section):
    """``checkpoint``: saving and loading."""

    keep_last: PosInt | None = None
    """meshtrain: keep only the newest keep_last checkpoints in the save folder (null keeps all)."""
    tag_validation: canonical_choice(("Ignore", "Warn", "Fail")) = "Warn"
    """What to do when ranks pass different tags to save_checkpoint: "Warn" (log it and save under rank 0's tag), "Ignore" (rank 0's tag, silently) or "Fail" (CheckpointError naming the tags); case-insensitive."""
    load_universal: Bool = False
    """Accepted and ignored: meshtrain loads any checkpoint under any mesh or ZeRO stage without conversion."""
    use_node_local_storage: Bool = False
    """Accepted and ignored: every rank writes into save_dir, which must be one folder all ranks see (a shared file system on several nodes)."""
    parallel_write: ParallelWriteConfig = ParallelWriteConfig()
    """DeepSpeed's parallel-write options."""
    async_save: Bool = False
    """meshtrain: save_checkpoint blocks only while this rank's state is copied to host memory (pinned on CUDA); the files are written and committed in a background thread, a second save waits for the first, and a failed write raises at the next step or save (docs/checkpoints.md)."""
    save_on_preemption: Bool = False
    """meshtrain: catch SIGTERM and SIGUSR1; at the next step boundary every rank saves a checkpoint (into save_dir; the Trainer and `meshtrain train` use their own checkpoint folder) and the process exits with code 75 (docs/checkpoints.md, Pre-emption)."""
    format: canonical_choice(("meshtrain", "dcp")) = "meshtrain"
    """meshtrain: what engine.save_checkpoint writes. "meshtrain": its own sharded safetensors format (any layout loads it). "dcp": a torch.distributed.checkpoint folder in torchtitan's keys (model state dict at the top, optimizer.state.<fqn>.exp_avg, ...), each rank writing its own chunks, which torch's dcp.load reads into FSDP2 and meshtrain's load_checkpoint resumes; not with async_save, and keep_last is not applied (docs/checkpoints.md)."""
    save_dir: Str | None = None
    """meshtrain: where the engine's own pre-emption save goes (save_on_preemption in a user loop; the Trainer uses its checkpoint folder)."""


class LossConfig(Section):
    """``loss``: how a causal LM's loss is computed (meshtrain; docs/memory.md)."""

    chunked: Bool = False
    """Chunked (fused linear) cross-entropy: the LM head and the loss in chunks of tokens, never the whole [tokens x vocab] logits; with labels, outputs.logits then holds the final hidden states. transformers *ForCausalLM and meshtrain's Decoder; tensor parallel too."""
    chunk_size: PosInt = 1024
    """Tokens per chunk: one [chunk_size x vocab] fp32 block is alive at a time."""
    global_aux_loss: Bool = False
    """meshtrain (Megatron's global_aux_loss): a MoE model's router load-balancing loss over the whole global batch (token fractions all-reduced over the data-parallel replicas), as one process on that batch computes it. Off (the default, as DDP, DeepSpeed and accelerate): each rank backpropagates the loss the model returns for its own micro-batch. The two differ because the loss is not linear in the batch (docs/moe.md)."""


class CompileConfig(Section):
    """``compile``: torch.compile of the model (applied after TP, pipeline split and checkpointing)."""

    enabled: Bool = False
    """Compile the model with torch.compile."""
    backend: Str = "inductor"
    """torch.compile backend name."""
    mode: (
        canonical_choice(
            ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
        )
        | None
    ) = None
    """torch.compile mode (null = torch's default)."""
    fullgraph: Bool = False
    """Require one graph without breaks (errors instead of falling back to eager)."""
    dynamic: Bool | None = None
    """Dynamic-shape tracing: true, false, or null (torch decides)."""
    options: dict[str, Any] | None = None
    """Backend options passed to torch.compile."""
    kwargs: dict[str, Any] = {}
    """Further keyword arguments passed to torch.compile (DeepSpeed's spelling)."""
    disable: Bool = False
    """DeepSpeed's older switch: true turns compilation off even when enabled."""
    deepcompile: Bool = False
    """Accepted and ignored (DeepSpeed's compiler passes)."""

    @property
    def active(self) -> bool:
        """True when the model should be compiled (enabled and not disabled)."""
        return self.enabled and not self.disable


class FP8Config(Section):
    """``fp8`` (meshtrain): float8 matmuls in the model's linear layers, through torchao."""

    enabled: Bool = False
    """meshtrain: swap the model's nn.Linear layers for torchao's Float8Linear with dynamic tensorwise scaling (inputs, weights and output gradients cast to float8 per tensor for each matmul; parameters, gradients and optimizer states keep their dtype). Needs the torchao package and a CUDA GPU of compute capability 8.9 or more (H100, H200, L4, L40S), else ConfigError. Not combined with tensor parallelism."""
    emulate: Bool = False
    """meshtrain: run the float8 casts and matmuls in emulation, on any device and without a speed-up (for tests on a CPU)."""
    skip_modules: list[Str] = ["lm_head"]
    """meshtrain: linear layers whose qualified name contains one of these strings stay in the model's dtype (the output projection is the most precision-sensitive matmul, as torchtitan keeps it). Layers whose in/out features are not multiples of 16 always stay."""


class MeshConfig(Section):
    """``mesh`` (meshtrain): the parallel layout pp x dp x cp x tp, with expert parallelism (ep) carved out of dp x cp; data parallelism takes the remaining ranks."""

    pipeline_parallel_size: PosInt = 1
    """Pipeline stages (pp); the model's layers are split into this many stages."""
    tensor_parallel_size: PosInt = 1
    """Tensor-parallel ranks (tp) sharing each layer; data-parallel size = world size / (pp * cp * tp)."""
    context_parallel_size: PosInt = 1
    """Context-parallel ranks (cp) holding different chunks of each sequence (2C chunks, rank i holds chunks i and 2C-1-i); attention spans them by context_parallel.method. meshtrain's Decoder and transformers Llama, Qwen2, Mistral, GPT-2 and Mixtral; docs/context_parallel.md."""
    expert_parallel_size: PosInt = 1
    """Expert-parallel ranks (ep), carved out of dp x cp: each holds 1/ep of every MoE layer's experts and tokens reach them by all-to-all (docs/moe.md). Needs a model with MoE layers meshtrain knows (transformers Mixtral, Qwen2-MoE, Qwen3-MoE, or the Decoder's model.moe) whose expert count it divides."""


class ContextParallelConfig(Section):
    """``context_parallel`` (meshtrain): how attention spans the cp ranks when mesh.context_parallel_size > 1 (docs/context_parallel.md)."""

    method: canonical_choice(("ring", "all_to_all")) = "ring"
    """ring: key/value blocks passed around the cp group with an online-softmax merge, overlapped with each block's compute; all_to_all (DeepSpeed Ulysses): re-shard from sequence to heads around attention. Read only when mesh.context_parallel_size > 1."""


class PipelineConfig(Section):
    """``pipeline`` (meshtrain): how pipeline stages run when mesh.pipeline_parallel_size > 1; micro-batches per step = gradient_accumulation_steps."""

    schedule: canonical_choice(
        ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev")
    ) = "1f1b"
    """Order of forwards and backwards: gpipe, 1f1b, interleaved_1f1b (virtual_stages per rank), zb_h1 (zero-bubble, backward split into input and weight gradients), or the V-shaped zero-bubble zbv and dualpipev (virtual_stages 2: rank r holds stages r and 2p-1-r; dualpipev needs gradient_accumulation_steps >= 2 x pipeline_parallel_size)."""
    virtual_stages: PosInt = 1
    """Model chunks per pipeline rank (interleaved_1f1b any, zbv and dualpipev exactly 2); the model is cut into pipeline_parallel_size x virtual_stages stages."""
    partition_method: Str = "parameters"
    """How the blocks are balanced over stages: "parameters" (parameter count), "uniform" (block count); meshtrain.pipe.PipelineModule also takes "type:REGEX"."""
    cut_points: list[int] | None = None
    """The first block index of each stage after the first (overrides partition_method), e.g. [4] for 2 stages."""

    @model_validator(mode="after")
    def _coherent(self) -> PipelineConfig:
        # caught here, at load, rather than on every rank after the model is split
        if self.schedule in ("zbv", "dualpipev") and self.virtual_stages != 2:
            raise ConfigError(
                f"pipeline.virtual_stages: {self.virtual_stages} with pipeline.schedule "
                f'"{self.schedule}": it holds two stages per rank in a V (rank r runs stages '
                "r and 2p-1-r); set pipeline.virtual_stages to 2"
            )
        if self.virtual_stages > 1 and self.schedule not in (
            "interleaved_1f1b",
            "zbv",
            "dualpipev",
        ):
            raise ConfigError(
                f"pipeline.virtual_stages: {self.virtual_stages} needs pipeline.schedule "
                f'"interleaved_1f1b" ({self.schedule} runs one stage per rank); set the '
                "schedule to interleaved_1f1b, or virtual_stages to 1"
            )
        method = self.partition_method
        if method not in _PARTITION_METHODS and not method.startswith("type:"):
            hint = did_you_mean(method, _PARTITION_METHODS).replace("valid keys", "use one of")
            raise ConfigError(
                f"pipeline.partition_method: {show(method)} is not allowed{hint} "
                '("type:REGEX" with meshtrain.pipe.PipelineModule)'
            )
        return self


_PARTITION_METHODS = ("parameters", "uniform")


class TensorParallelConfig(Section):
    """``tensor_parallel``: DeepSpeed's AutoTP section, plus meshtrain's sequence parallelism and plans."""

    autotp_size: NonNegInt = 0
    """DeepSpeed's name for the tensor-parallel size: the same setting as mesh.tensor_parallel_size (give either, or both equal); 0 = not set."""
    sequence_parallel: Bool = False
    """Run norms and dropout between tensor-parallel regions on 1/T of the sequence: each all-reduce becomes a reduce-scatter plus an all-gather (same bytes, 1/T of the activation memory there). The sequence length must be a multiple of the tensor-parallel size. Supported by every built-in plan (meshtrain decoder, Llama/Qwen2/Mistral, GPT-2, BERT); under a pipeline by all of them, where each stage sends its 1/T sequence shard (not with a meshtrain.pipe.PipelineModule: refused)."""
    plan: dict[str, Any] | None = None
    """A tensor-parallel plan for a model without a built-in one: {"rows": [[module path, style, units?, blocks?], ...], "sizes": {"heads": "config.n_heads", ...}}; see docs/tensor_parallel.md. null = the built-in plan for the model's class."""
    tp_overlap_comm: Bool = False
    """Accepted and ignored (DeepSpeed AutoTP all-reduce overlap)."""
    vocab_parallel_lm_head: Bool | None = None
    """Accepted and ignored: meshtrain's plans always shard the LM head over the vocabulary and use the vocab-parallel loss."""
    partition_config: dict[str, Any] | None = None
    """Accepted and ignored (DeepSpeed AutoTP regex partition rules); write a meshtrain plan in tensor_parallel.plan instead."""
    preset_model: Str | None = None
    """Accepted and ignored (DeepSpeed AutoTP presets); meshtrain picks the plan from the model's class."""

    @model_validator(mode="after")
    def _plan_parses(self) -> TensorParallelConfig:
        # a bad plan is refused at load, not on every rank once tensor parallelism applies
        if self.plan is not None:
            from meshtrain.families.tp_plan import TPPlan

            TPPlan.from_dict(self.plan)
        return self


class DistributedConfig(Section):
    """``distributed`` (meshtrain): process-group settings."""

    timeout_minutes: PosFloat = 5.0
    """Collective timeout in minutes: a dead or stuck peer becomes an error after this long instead of a hang."""
    first_step_timeout_minutes: PosFloat | None = None
    """meshtrain: the collective timeout until the first optimizer step has finished (compile, warm-up, a node still loading), at least timeout_minutes; after it, timeout_minutes. None: timeout_minutes throughout."""
    backend: canonical_choice(("auto", "gloo", "nccl")) = "auto"
    """torch.distributed backend: "auto" picks nccl on CUDA devices and gloo otherwise."""

    @model_validator(mode="after")
    def _first_step_not_shorter(self) -> DistributedConfig:
        # a shorter first-step bound would kill the slow step it exists to let through
        first = self.first_step_timeout_minutes
        if first is not None and first < self.timeout_minutes:
            raise ConfigError(
                f"distributed.first_step_timeout_minutes: {first:g} is shorter than "
                f"distributed.timeout_minutes ({self.timeout_minutes:g}); set it to at least "
                "that, or leave it unset"
            )
        return self


__all__ = [
    "ActivationCheckpointingConfig",
    "AmpConfig",
    "BF16Config",
    "CheckpointConfig",
    "CompileConfig",
    "DistributedConfig",
    "FP16Config",
    "MeshConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "PipelineConfig",
    "ParallelWriteConfig",
    "TensorBoardConfig",
    "TensorParallelConfig",
    "ZeroConfig",
]

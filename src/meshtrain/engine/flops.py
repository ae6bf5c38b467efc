"""Model FLOPs utilisation (MFU): model FLOPs per token x tokens/s / peak FLOPs.

FLOPs per token for a decoder (PaLM, Chowdhery et al. 2022, appendix B): ``6 N`` for the
matmuls of forward and backward over ``N`` parameters (embeddings included, an upper
bound), plus ``12 L d T`` for attention scores and values at sequence length ``T`` over
``L`` layers of width ``d``. Activation recomputation is not counted (it is *model* FLOPs
utilisation). ``N`` counts each parameter once (not per ZeRO shard).

Peak FLOP/s, per device, dense (no 2:4 sparsity), from NVIDIA's data sheets: H100 SXM5
and H200 SXM (same tensor cores) 989.4 TFLOP/s bf16/fp16, 494.7 tf32, 66.9 fp32; A100
SXM4 312 bf16/fp16, 156 tf32, 19.5 fp32; L40S 362.05 bf16/fp16, 183 tf32, 91.6 fp32;
L4 121 bf16/fp16, 60 tf32, 30.3 fp32; A10 125 bf16/fp16, 62.5 tf32, 31.2 fp32. H100 PCIe
(756 bf16) is matched before "H100". Name matching is on ``torch.cuda.get_device_name``.
On CPU, or a GPU not in the table, the peak is *measured*: the best of a few square fp32
matmuls on this process's threads, labelled ``measured``.
"""

from __future__ import annotations

import time

import torch

# (name fragment, {dtype: TFLOP/s dense}); first match wins, so specific names go first
GPU_PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
)


def flops_per_token(n_params: int, n_layers: int, dim: int, seq_len: int) -> float:
    """``6 N + 12 L d T`` (module docstring)."""
    return 6.0 * n_params + 12.0 * n_layers * dim * seq_len


def model_shape(model: torch.nn.Module) -> tuple[int, int] | None:
    """(layers, width) of meshtrain's Decoder or a transformers model, from its config."""
    cfg = getattr(model, "config", None)
    for layers, width in (("n_layers", "dim"), ("num_hidden_layers", "hidden_size")):
        if cfg is not None and hasattr(cfg, layers) and hasattr(cfg, width):
            return int(getattr(cfg, layers)), int(getattr(cfg, width))
    return None


def measure_cpu_peak(size: int = 512, seconds: float = 0.2) -> float:
    """Best fp32 matmul FLOP/s of this process's threads over about ``seconds``.

    The operands come from a private generator: drawing them from torch's default one
    would shift every random number the user's script draws afterwards (dropout masks,
    shuffles), which no peer does at set-up."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2.0 * size**3 / max(time.perf_counter() - t0, 1e-9))
    return best


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s of one device for ``dtype``, where the figure comes from)."""
    key = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if key == "fp32" and torch.backends.cuda.matmul.allow_tf32:
            key = "tf32"
        for fragment, table in GPU_PEAK_TFLOPS:
            if fragment in name:
                return table[key] * 1e12, f"{name} {key} data sheet"
    return measure_cpu_peak(), f"measured fp32 matmul peak ({torch.get_num_threads()} threads)"


def attach_mfu(log, model: torch.nn.Module, zero, device: torch.device, dtype) -> None:
    """Give the step log what MFU needs, for models whose shape is known (else nothing)."""
    shape = model_shape(model)
    if shape is None:
        return
    n = sum(p.numel() for p in model.parameters())
    if zero.stage == 3:  # sharded parameters are empty placeholders between uses
        whole = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        n = zero.trainable_numel + zero.frozen_sharded_numel + whole
    peak, source = peak_flops(device, dtype)
    # FLOPs per token = 6N + 12 L d T, T read from each batch's input_ids
    log.set_mfu(6.0 * n, flops_per_token(0, *shape, 1), peak, source)

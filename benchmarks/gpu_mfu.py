"""MFU of a ~1B-parameter Llama-style decoder on one GPU: bf16, SDPA (flash) attention,
torch.compile, through the meshtrain engine. Not run in CI; needs CUDA.

    python -m benchmarks.gpu_mfu                      # ~0.95B params, seq 2048, 20 steps
    python -m benchmarks.gpu_mfu --layers 4 --steps 5 # a quick check
    python -m benchmarks.gpu_mfu --zero-stage 2 --offload   # ZeRO-Offload: AdamW on the CPU

The model is ``meshtrain.models.Decoder`` (pre-norm, RoPE, SwiGLU,
``F.scaled_dot_product_attention`` with ``is_causal=True``, which dispatches to the flash
kernel in bf16): d=2048, 16 layers, 16 heads, SwiGLU 5632, vocab 32000, untied: 0.95B
parameters. MFU = (6N + 12 L d T) x tokens/s / peak, the peak from
``meshtrain.engine.flops`` (H100 SXM bf16 989.4 TFLOP/s dense). Anchors from issue 12:
torchtitan 33-39% (Llama-3 8B, H100), Megatron-Core 41-49%; the target is 50%.
Prints one JSON line with tokens/s, MFU, peak memory and the GPU name.
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_mfu")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    ap.add_argument(
        "--offload",
        action="store_true",
        help="ZeRO-Offload: optimizer states and step on the CPU (needs --zero-stage >= 1)",
    )
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_mfu needs a CUDA GPU (none found)")
    import meshtrain
    from meshtrain.engine import flops
    from meshtrain.models import Decoder, DecoderConfig

    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = DecoderConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        ffn_dim=args.ffn,
        max_seq_len=args.seq,
        seed=1234,
    )
    model = Decoder(cfg)
    n = sum(p.numel() for p in model.parameters())
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "compile": {"enabled": not args.no_compile},
        "steps_per_print": 10**9,
        "zero_optimization": {
            "stage": args.zero_stage,
            **({"offload_optimizer": {"device": "cpu"}} if args.offload else {}),
        },
    }
    engine, *_ = meshtrain.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    device = engine.device
    x = torch.randint(0, args.vocab, (args.micro_batch, args.seq), device=device)
    for i in range(args.steps):
        if i == args.warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens_per_s = (args.steps - args.warmup) * args.micro_batch * args.seq / seconds
    peak, source = flops.peak_flops(device, torch.bfloat16)
    fpt = flops.flops_per_token(n, args.layers, args.dim, args.seq)
    print(
        json.dumps(
            {
                "gpu": torch.cuda.get_device_name(device),
                "params": n,
                "tokens_per_s": round(tokens_per_s, 1),
                "mfu": round(fpt * tokens_per_s / peak, 4),
                "peak_source": source,
                "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "compile": not args.no_compile,
                "zero_stage": args.zero_stage,
                "offload": args.offload,
                "loss": float(loss),
            }
        )
    )
    meshtrain.shutdown_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

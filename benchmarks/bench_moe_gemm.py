"""The experts' SwiGLU: ``torch._grouped_mm`` against the per-expert loop, forward + backward.

``meshtrain.parallel.experts.gemm`` picks one of the two per layer at its first forward
(grouped where the kernel runs for the weights' device and dtype). This measures both on
the same rows, one process, on the device given (CPU by default; ``--device cuda`` on a
GPU, where ``_grouped_mm`` needs bf16): ``L`` local experts of hidden ``H`` and expert
size ``F``, ``--tokens`` rows split over the experts ``balanced`` (equal) or ``skewed``
(half the rows to one expert, a quarter of the experts empty). Each case: median of
``--repeats`` timings of ``--iters`` forward+backward passes after ``--warmup``; checks
that both give the same output and gradients (1e-5 relative in fp32, 2e-2 in bf16).
Prints ms per pass and the ratio loop / grouped (> 1: grouped is faster). Results:
``benchmarks/results/moe-gemm-<date>-<HHMM>.json``.

    python -m benchmarks.bench_moe_gemm [--device cpu] [--dtype fp32] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from meshtrain.parallel.experts import gemm

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def counts_for(tokens: int, experts: int, layout: str) -> list[int]:
    if layout == "balanced":
        base = [tokens // experts] * experts
        base[0] += tokens - sum(base)
        return base
    counts = [0] * experts
    counts[0] = tokens // 2
    live = list(range(1, experts - experts // 4))  # the last quarter of the experts: empty
    for i in range(tokens - counts[0]):
        counts[live[i % len(live)]] += 1
    return counts


def one_pass(impl, x, gate_up, down, counts, g):
    for t in (x, gate_up, down):
        t.grad = None
    y = gemm.SWIGLU[impl](x, gate_up, down, counts, F.silu)
    y.backward(g)
    return y


def timed(impl, args, iters, warmup, repeats, sync) -> float:
    for _ in range(warmup):
        one_pass(impl, *args)
    runs = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            one_pass(impl, *args)
        sync()
        runs.append((time.perf_counter() - t0) / iters * 1e3)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--experts", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n_exp in args.experts:
        gate_up = torch.randn(n_exp, 2 * args.ffn, args.hidden, generator=gen) * 0.05
        down = torch.randn(n_exp, args.hidden, args.ffn, generator=gen) * 0.05
        gate_up = gate_up.to(device, dtype).requires_grad_()
        down = down.to(device, dtype).requires_grad_()
        chosen = gemm.choose(gate_up, down, F.silu)
        for layout in ("balanced", "skewed"):
            counts = counts_for(args.tokens, n_exp, layout)
            x = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype)
            x.requires_grad_()
            g = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype)
            case = (x, gate_up, down, counts, g)
            row = {"experts": n_exp, "layout": layout, "chosen": chosen}
            if chosen == "grouped":
                got = {}
                for impl in gemm.GEMMS:
                    y = one_pass(impl, *case)
                    got[impl] = [y.detach(), x.grad, gate_up.grad, down.grad]
                err = max(
                    float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
                    for a, b in zip(got["grouped"], got["loop"], strict=True)
                )
                limit = 1e-5 if dtype == torch.float32 else 2e-2
                assert err < limit, f"grouped vs loop differ by {err:.2e} ({n_exp}, {layout})"
                row["max_rel_diff"] = err
            for impl in gemm.GEMMS if chosen == "grouped" else ("loop",):
                row[f"{impl}_ms"] = timed(impl, case, args.iters, args.warmup, args.repeats, sync)
            if chosen == "grouped":
                row["loop_over_grouped"] = row["loop_ms"] / row["grouped_ms"]
            rows.append(row)
            line = f"experts {n_exp:3d} {layout:8s} chose {chosen:7s} loop {row['loop_ms']:8.2f} ms"
            if chosen == "grouped":
                line += (
                    f"  grouped {row['grouped_ms']:8.2f} ms  loop/grouped "
                    f"{row['loop_over_grouped']:.2f}x  (diff {row['max_rel_diff']:.1e})"
                )
            print(line, flush=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    out = {
        "date": now.isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "processor": platform.processor(),
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "args": vars(args),
        "rows": rows,
    }
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    path = results / f"moe-gemm-{now:%Y%m%d-%H%M}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"results: {path}")


if __name__ == "__main__":
    main()

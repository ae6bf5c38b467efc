"""Peak memory of the LM head + cross-entropy, plain vs chunked, on a 150k vocabulary.

Each variant runs forward + backward in a fresh process (so the peak is its own); the
peak is host RSS growth (``VmHWM`` minus the RSS once the inputs exist; this machine has
no GPU). The plain path holds the fp32 logits ``[N, V]`` and their gradient; the chunked
one a ``[chunk, V]`` block. Prints the peaks, the logits' size and the ratio, and writes
JSON to benchmarks/results/.

    python benchmarks/bench_chunked_loss.py [--tokens 512] [--vocab 150000] [--hidden 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import sys, torch, torch.nn.functional as F
from meshtrain.loss import chunked_cross_entropy
def rss(field):
    for line in open('/proc/self/status'):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
mode, n, v, hdim, chunk = sys.argv[1], *map(int, sys.argv[2:6])
torch.manual_seed(0)
h = torch.randn(n, hdim, requires_grad=True)
w = (torch.randn(v, hdim) * 0.02).requires_grad_()
t = torch.randint(0, v, (n,))
w.grad = torch.zeros_like(w); h.grad = torch.zeros_like(h)  # gradients exist in both
base = rss('VmRSS')
if mode == 'plain':
    loss = F.cross_entropy(h @ w.t(), t)
else:
    loss = chunked_cross_entropy(h, w, t, chunk_size=chunk)
loss.backward()
print(rss('VmHWM') - base, float(loss))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=150_000)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=64)
    args = ap.parse_args()
    out = {}
    for mode in ("plain", "chunked"):
        argv = [mode, args.tokens, args.vocab, args.hidden, args.chunk]
        res = subprocess.run(
            [sys.executable, "-c", CHILD, *map(str, argv)],
            capture_output=True,
            text=True,
            check=True,
        )
        peak, loss = res.stdout.split()
        out[mode] = {"peak_bytes": int(peak), "loss": float(loss)}
    logits = args.tokens * args.vocab * 4
    mib = 2**20
    print(f"tokens {args.tokens}, vocab {args.vocab}, hidden {args.hidden}, chunk {args.chunk}")
    print(f"fp32 logits [N, V]: {logits / mib:.1f} MiB")
    for mode, r in out.items():
        print(f"{mode:8s} peak +{r['peak_bytes'] / mib:8.1f} MiB   loss {r['loss']:.6f}")
    drop = out["plain"]["peak_bytes"] - out["chunked"]["peak_bytes"]
    print(
        f"drop {drop / mib:.1f} MiB = {drop / logits:.2f} x the logits; "
        f"chunked / plain = {out['chunked']['peak_bytes'] / out['plain']['peak_bytes']:.3f}"
    )
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (results / f"bench_chunked_loss-{stamp}.json").write_text(
        json.dumps({"args": vars(args), "logits_bytes": logits, "runs": out}, indent=2)
    )


if __name__ == "__main__":
    main()

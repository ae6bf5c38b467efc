"""``loss.png`` of ``meshtrain train``: training and held-out loss, and perplexity, side by side.

Left, the loss in nats per token: rank 0's training loss per step (pale), its moving
average, and the held-out loss at each evaluation (``eval_loss`` rows, red markers).
Right, the same two as perplexity, ``exp(loss)``, on a log axis (a uniform guess over a
vocabulary of V tokens has perplexity V, the value at step 0): the moving average's
``exp`` beside the held-out perplexity. The moving average is TensorBoard's debiased EMA
(weight 0.9), so the curve is not pulled towards its first value. Drawn from the whole
``metrics.jsonl``, resumed runs included (a dotted line marks where this run resumed).
matplotlib comes with the ``examples`` extra; without it there is no plot (False).
"""

from __future__ import annotations

import math
from pathlib import Path

from meshtrain.files.atomic import atomic_path
from meshtrain.trainer.run_log import read_metrics


def smoothed(values: list[float], weight: float = 0.9) -> list[float]:
    """Debiased exponential moving average (module docstring)."""
    out, ema = [], 0.0
    for t, value in enumerate(values, start=1):
        ema = weight * ema + (1 - weight) * value
        out.append(ema / (1 - weight**t))
    return out


def plot_run(metrics: str | Path, out: str | Path, title: str, resumed_at: int = 0) -> bool:
    """Draw ``metrics`` into ``out`` (PNG, written atomically); False without matplotlib."""
    rows = read_metrics(metrics)
    train = [r for r in rows if r.get("loss") is not None]
    evals = [r for r in rows if r.get("eval_loss") is not None]
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed; must precede pyplot
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = [r["step"] for r in train]
    losses = [r["loss"] for r in train]
    smooth = smoothed(losses)
    e_steps = [r["step"] for r in evals]
    e_loss = [r["eval_loss"] for r in evals]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    left.plot(steps, losses, color="#9ab8d8", linewidth=0.8, label="training loss (rank 0)")
    left.plot(steps, smooth, color="#1f4e8c", linewidth=1.8, label="training, moving average")
    right.plot(
        steps, [math.exp(v) for v in smooth], color="#1f4e8c", linewidth=1.8, label="training"
    )
    if evals:
        left.plot(e_steps, e_loss, "o-", color="#c0504d", label="held-out loss")
        right.plot(e_steps, [math.exp(v) for v in e_loss], "o-", color="#c0504d", label="held-out")
        last = evals[-1]
        right.annotate(
            f"{math.exp(last['eval_loss']):,.0f}",
            (last["step"], math.exp(last["eval_loss"])),
            textcoords="offset points",
            xytext=(0, 8),
            ha="center",
            color="#c0504d",
            fontsize=9,
        )
    for ax in (left, right):
        if resumed_at:
            ax.axvline(resumed_at, color="#888888", linestyle=":", label=f"resumed at {resumed_at}")
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    left.set_ylabel("cross-entropy (nats/token)")
    right.set_ylabel("perplexity, exp(loss)")
    right.set_yscale("log")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with atomic_path(out) as tmp:  # the temp keeps the suffix: savefig's format
        fig.savefig(tmp)
    plt.close(fig)
    return True


__all__ = ["plot_run", "smoothed"]

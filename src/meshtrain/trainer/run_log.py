"""What rank 0 of ``meshtrain train`` shows and writes while it trains.

* a tqdm progress bar over optimizer steps with loss, tokens/s and tqdm's ETA (only on a
  terminal: in a CI log a bar is a wall of carriage returns, and the engine's
  ``steps_per_print`` line already reports progress there);
* ``metrics.jsonl``: one JSON object per optimizer step, the engine's per-step numbers
  (``engine.log.last``) plus the wall-clock time since the job started;
* TensorBoard events (``tensorboard.enabled``), loss / lr / grad norm / throughput / comm;
* ``loss.png`` at the end, drawn from the whole ``metrics.jsonl``, resumed runs included.

The loss is rank 0's (the mean over its micro-batches of the step), as DeepSpeed logs it:
averaging over ranks would add a collective to every step for a number that only differs
by data noise. On resume, lines after the resumed step (written by a run that crashed
after its last checkpoint) are dropped, and TensorBoard purges them too, so every step
appears once. matplotlib and tensorboard come with the ``examples`` extra; each is
imported when first used and, when missing, the run goes on without that output and
says how to get it.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from meshtrain.files.atomic import atomic_path, write_atomic

log = logging.getLogger("meshtrain")

METRICS = "metrics.jsonl"
PLOT = "loss.png"
_MISSING = 'pip install "meshtrain[examples]"'


class _TqdmHandler(logging.Handler):
    """Log lines written above the progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never break training
            self.handleError(record)


class RunLog:
    """Rank 0's progress bar, JSONL log and TensorBoard writer for one run.

    Use as a context manager; ``step(row)`` after every optimizer step.
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        start_step: int,
        max_steps: int,
        tensorboard_dir: str | Path | None,
        progress: bool | None = None,
    ) -> None:
        self.dir = Path(output_dir)
        self.start_step = start_step
        self.max_steps = max_steps
        self.tensorboard_dir = tensorboard_dir
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.t0 = time.perf_counter()
        self.rows: list[dict[str, Any]] = []  # this run's steps
        self._bar = None
        self._tb = None
        self._file = None
        self._handler: logging.Handler | None = None
        self._saved_logger: tuple[int, bool] | None = None

    # -- lifetime -----------------------------------------------------------------------
    def __enter__(self) -> RunLog:
        from tqdm.auto import tqdm

        self.dir.mkdir(parents=True, exist_ok=True)
        _truncate_after(self.dir / METRICS, self.start_step)
        self._file = open(self.dir / METRICS, "a", encoding="utf-8")
        self._bar = tqdm(
            total=self.max_steps,
            initial=self.start_step,
            desc="train",
            unit="step",
            disable=not self.progress,
            dynamic_ncols=True,
            file=sys.stderr,
        )
        # the engine's steps_per_print lines go above the bar (and stay in the scrollback)
        self._handler = _TqdmHandler()
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        # the bar's handler replaces the engine's default stdout one while the bar is shown
        self._saved_logger = (log.level, log.propagate, list(log.handlers))
        log.handlers = [self._handler]
        log.setLevel(logging.INFO)
        log.propagate = False
        self._tb = self._open_tensorboard()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._handler is not None:
            log.level, log.propagate, log.handlers = self._saved_logger  # type: ignore[misc]

    def _open_tensorboard(self):
        if self.tensorboard_dir is None:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            self.write(
                f"note: TensorBoard events are not written (tensorboard missing; {_MISSING})"
            )
            return None
        # purge_step drops events of steps a crashed run wrote after its last checkpoint
        return SummaryWriter(str(self.tensorboard_dir), purge_step=self.start_step + 1)

    # -- per step -----------------------------------------------------------------------
    def write(self, message: str) -> None:
        """A line above the progress bar (stderr)."""
        from tqdm.auto import tqdm

        tqdm.write(message, file=sys.stderr)

    def step(self, last: dict[str, Any]) -> dict[str, Any]:
        """Record one optimizer step from ``engine.log.last``; returns the JSONL row."""
        row = {
            "step": int(last["step"]),
            "loss": _num(last.get("loss")),
            "lr": _num(last.get("lr")),
            "grad_norm": _num(last.get("grad_norm")),
            "loss_scale": _num(last.get("loss_scale")),
            "tokens_per_s": _num(last.get("tokens_per_s")),
            "samples_per_s": _num(last.get("samples_per_s")),
            "comm_bytes": int(last.get("comm_bytes") or 0),
            "step_seconds": _num(last.get("seconds")),
            "skipped": bool(last.get("skipped")),
            "elapsed_s": round(time.perf_counter() - self.t0, 3),
        }
        self.rows.append(row)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s"):
                if row[key] is not None:
                    self._tb.add_scalar(f"train/{key}", row[key], row["step"])
            self._tb.add_scalar("train/comm_bytes", row["comm_bytes"], row["step"])
        loss = "nan" if row["loss"] is None else f"{row['loss']:.4f}"
        self._bar.set_postfix_str(
            f"loss {loss}  {row['tokens_per_s'] or 0:,.0f} tok/s  lr {row['lr'] or 0:.2e}",
            refresh=False,
        )
        self._bar.update(row["step"] - self._bar.n)
        return row

    def record(self, step: int, values: dict[str, Any]) -> dict[str, Any]:
        """A non-step row (e.g. the Trainer's ``eval_*`` metrics) into the JSONL and
        TensorBoard (``eval_loss`` -> ``eval/loss``); the loss plot marks ``eval_loss``."""
        row = {"step": int(step), **{k: _num(v) if k != "epoch" else v for k, v in values.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in row.items():
                if key.startswith("eval_") and value is not None:
                    self._tb.add_scalar(f"eval/{key[5:]}", value, row["step"])
        return row


def _num(value: Any) -> float | None:
    """A JSON-safe float (NaN/inf -> None: JSON has no NaN)."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl, skipping a torn last line from a crash."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
    except FileNotFoundError:
        return []
    return rows


def _truncate_after(path: Path, step: int) -> None:
    """Keep only rows with ``step <= step`` (a fresh run, step 0, starts an empty file)."""
    if not path.exists():
        return
    kept = [r for r in read_metrics(path) if int(r.get("step", 0)) <= step]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


def plot_loss(
    metrics: str | Path,
    out: str | Path,
    title: str,
    resumed_at: int = 0,
    ylabel: str = "cross-entropy (nats/token)",
) -> bool:
    """Draw the loss curve of ``metrics`` into ``out`` (PNG); False when matplotlib is missing."""
    everything = read_metrics(metrics)
    rows = [r for r in everything if r.get("loss") is not None]
    evals = [r for r in everything if r.get("eval_loss") is not None]
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed; must precede pyplot
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = [r["step"] for r in rows]
    losses = [r["loss"] for r in rows]
    smooth, ema = [], 0.0
    for t, value in enumerate(losses, start=1):
        # an EMA shows the trend through per-batch noise; dividing by 1 - 0.9^t removes
        # its pull towards the first value (TensorBoard's debiased smoothing)
        ema = 0.9 * ema + 0.1 * value
        smooth.append(ema / (1 - 0.9**t))
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.plot(steps, losses, color="#9ab8d8", linewidth=0.8, label="loss (rank 0)")
    ax.plot(steps, smooth, color="#1f4e8c", linewidth=1.8, label="moving average")
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["eval_loss"] for r in evals],
            "o-",
            color="#c0504d",
            label="eval loss",
        )
    if resumed_at:
        ax.axvline(resumed_at, color="#888888", linestyle=":", label=f"resumed at {resumed_at}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(out) as tmp:  # the temp name keeps the .png suffix savefig reads
        fig.savefig(tmp)
    plt.close(fig)
    return True


__all__ = ["METRICS", "PLOT", "RunLog", "plot_loss", "read_metrics"]

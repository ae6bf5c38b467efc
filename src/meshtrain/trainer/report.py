"""What rank 0 prints: the "***** Running training *****" header transformers users know,
and a table of the run at the end (one row per evaluation, or per logged step when there
were no evaluations)."""

from __future__ import annotations

from typing import Any


def training_header(
    *,
    num_examples: int,
    num_epochs: int,
    per_device: int,
    total_batch: int,
    accumulation: int,
    max_steps: int,
    num_params: int,
    processes: int,
    zero_stage: int,
    precision: str,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> str:
    dp = processes // (tensor_parallel * pipeline_parallel)
    mesh = "".join(
        f"{name} parallel {size} x "
        for name, size in (("pipeline", pipeline_parallel), ("tensor", tensor_parallel))
        if size > 1
    )
    mesh = f"{mesh}data parallel {dp}, " if mesh else ""
    return "\n".join(
        [
            "***** Running training *****",
            f"  Num examples = {num_examples:,}",
            f"  Num Epochs = {num_epochs:,}",
            f"  Instantaneous batch size per device = {per_device:,}",
            f"  Total train batch size (w. parallel, distributed & accumulation) = {total_batch:,}",
            f"  Gradient Accumulation steps = {accumulation}",
            f"  Total optimization steps = {max_steps:,}",
            f"  Number of trainable parameters = {num_params:,}",
            f"  meshtrain: {processes} process(es), "
            + mesh
            + f"ZeRO stage {zero_stage}, {precision}",
        ]
    )


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6f}"
    return "-" if value is None else str(value)


def end_table(log_history: list[dict[str, Any]]) -> str:
    """Epoch | Step | Training Loss | Validation Loss | <metrics>, like transformers'
    notebook table: the training loss is the last one logged before each evaluation."""
    rows: list[dict[str, Any]] = []
    last_loss = None
    evals = [h for h in log_history if "eval_loss" in h or any(k.startswith("eval_") for k in h)]
    for h in log_history:
        if "loss" in h:
            last_loss = h["loss"]
            if not evals:
                rows.append(
                    {"Epoch": h.get("epoch"), "Step": h.get("step"), "Training Loss": h["loss"]}
                )
        elif h in evals:
            row = {"Epoch": h.get("epoch"), "Step": h.get("step"), "Training Loss": last_loss}
            row["Validation Loss"] = h.get("eval_loss")
            for k, v in h.items():
                if (
                    k.startswith("eval_")
                    and k != "eval_loss"
                    and not k.endswith(("_runtime", "_per_second"))
                ):
                    row[k[5:].replace("_", " ").title()] = v
            rows.append(row)
    if not rows:
        return ""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]

    def line(items):
        return "| " + " | ".join(s.rjust(w) for s, w in zip(items, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cols), sep, *(line(c) for c in cells)])


__all__ = ["end_table", "training_header"]

"""The longest sequence one GPU trains: the ~1B decoder, bf16, micro-batch 1, with
activation checkpointing and the chunked loss beside the same without them.

For each configuration the engine takes whole optimizer steps (forward, backward, AdamW)
at growing lengths; the first that runs out of memory ends that configuration's climb.
Each step's peak (``torch.cuda.max_memory_allocated``) is set beside the planner's
prediction (``plan.memory.predict_memory`` for that layout, tensors only: model states +
activations + buffers, without the assumed framework overhead).

Attention is SDPA's flash kernel (no ``[L, L]`` scores are kept), so memory grows
linearly in ``L`` while time grows as ``L^2``: with checkpointing the memory limit lies
beyond what a step inside this run's budget can reach. So besides the longest length
that ran, the section fits ``peak = a + b L`` over the lengths it measured and reports the
length where that line meets the device's memory (``extrapolated_max_tokens``), with the
step time that length would take from the measured ``L^2`` growth. The anchor is ALST
(Arctic Long Sequence Training): 500k tokens on one H100 80 GB for Llama-8B, with tiled
MLP, activation offload to the CPU and sequence tiling of the loss.
"""

from __future__ import annotations

import math
import time

ROWS = ("plain_max_tokens", "ac_chunked_max_tokens", "ac_chunked_extrapolated_max_tokens",
        "peak_over_prediction")  # fmt: skip

BIG = dict(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, ffn_dim=5632)
TINY = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_dim=176)

# lengths tried per configuration, in order (the climb stops at the first out-of-memory)
FULL_LENGTHS = {
    "plain": (8192, 16384, 32768, 49152, 65536, 98304),
    "ac_chunked": (32768, 65536, 131072, 196608, 262144),
}
DRY_LENGTHS = {"plain": (64, 128), "ac_chunked": (64, 128, 256)}
CONFIGS = {
    "plain": {},
    "ac_chunked": {
        "activation_checkpointing": {"enabled": True},
        "loss": {"chunked": True, "chunk_size": 1024},
    },
}


def _engine(ctx, spec: dict, max_len: int, extra: dict):
    import meshtrain
    from meshtrain.models import Decoder, DecoderConfig

    model = Decoder(DecoderConfig(**spec, max_seq_len=max_len, seed=1234))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "fused": True}},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        **({"bf16": {"enabled": True}} if ctx.cuda else {}),
        **extra,
    }
    engine, *_ = meshtrain.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)  # fmt: skip
    return engine


def _prediction(engine, length: int, name: str, cuda: bool) -> int | None:
    """The planner's peak tensor bytes for this layout at ``length`` tokens."""
    from meshtrain.plan.hardware import Hardware
    from meshtrain.plan.layout import Layout
    from meshtrain.plan.memory import predict_memory
    from meshtrain.plan.model_facts import ModelFacts
    from meshtrain.plan.validity import LayoutCheck

    facts = ModelFacts.of(engine.module)
    ac = name == "ac_chunked"
    layout = Layout(micro_batch=1, checkpointing=ac, loss_chunk=1024 if ac else 0)
    precision = "bf16" if cuda else "fp32"
    mem = predict_memory(facts, layout, LayoutCheck(facts, length, precision),
                         Hardware.named("H200"), seq=length, precision=precision,
                         optimizer="AdamW")  # fmt: skip
    return int(mem.tensors)


def _step(ctx, engine, length: int, vocab: int) -> tuple[float, float | None]:
    """One optimizer step at ``length`` tokens: (seconds, peak GiB)."""
    torch = ctx.torch
    g = torch.Generator().manual_seed(length)
    x = torch.randint(0, vocab, (1, length), generator=g).to(ctx.device)
    ctx.reset_peak()
    t0 = time.perf_counter()
    loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    ctx.sync()
    seconds = time.perf_counter() - t0
    if not math.isfinite(float(loss.detach())):
        raise RuntimeError(f"loss is {float(loss)} at {length} tokens")
    return seconds, ctx.peak_gib()


def _fit(points: list[dict]) -> tuple[float, float] | None:
    """Least squares ``peak_gib = a + b L`` over the measured points."""
    pts = [(p["tokens"], p["peak_gib"]) for p in points if p.get("peak_gib") is not None]
    if len(pts) < 2:
        return None
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    return my - b * mx, b


def section(ctx) -> dict:
    torch = ctx.torch
    spec, lengths = (TINY, DRY_LENGTHS) if ctx.dry else (BIG, FULL_LENGTHS)
    budget = getattr(ctx, "budget_s", 1e9)
    t_start = time.perf_counter()
    res: dict = {"model": dict(spec), "micro_batch": 1}
    if ctx.cuda:
        free, total = torch.cuda.mem_get_info()
        res["device_gib"] = round(total / 2**30, 2)
    cap_gib = res.get("device_gib")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = [SDPBackend.FLASH_ATTENTION] if ctx.cuda else [SDPBackend.MATH]
    for name, extra in CONFIGS.items():
        points: list[dict] = []
        res[name] = {"points": points}
        engine = None
        try:
            engine = _engine(ctx, spec, max(lengths[name]), extra)
            last_s, last_len = None, None
            for length in lengths[name]:
                elapsed = time.perf_counter() - t_start
                if last_s is not None:  # the next step's time from the L^2 growth
                    guess = last_s * (length / last_len) ** 2
                    if elapsed + guess > budget:
                        res[name]["stopped"] = f"budget: {length} tokens would take ~{guess:.0f} s"
                        break
                point: dict = {"tokens": length}
                try:
                    point["predicted_gib"] = round(
                        _prediction(engine, length, name, ctx.cuda) / 2**30, 3
                    )
                except Exception as exc:  # noqa: BLE001 - the prediction is a figure, not the run
                    point["prediction_error"] = repr(exc)[:300]
                try:
                    with sdpa_kernel(kernels):
                        seconds, peak = _step(ctx, engine, length, spec["vocab_size"])
                except torch.cuda.OutOfMemoryError as exc:
                    point["oom"] = str(exc).splitlines()[0][:200]
                    points.append(point)
                    break
                point.update(seconds=round(seconds, 3), peak_gib=peak,
                             tokens_per_s=round(length / seconds, 1))  # fmt: skip
                if peak is not None and point.get("predicted_gib"):
                    point["peak_over_prediction"] = round(peak / point["predicted_gib"], 3)
                points.append(point)
                last_s, last_len = seconds, length
        except Exception as exc:  # noqa: BLE001 - recorded, the next configuration runs
            res[name]["error"] = repr(exc)[:500]
        finally:
            del engine
            ctx.free()
        ran = [p for p in points if "seconds" in p]
        res[f"{name}_max_tokens"] = max((p["tokens"] for p in ran), default=None)
        fit = _fit(ran)
        if fit and cap_gib:
            a, b = fit
            limit = int((cap_gib - a) / b) if b > 0 else None
            res[name]["fit_gib"] = {"a": round(a, 3), "b_per_token": b}
            res[f"{name}_extrapolated_max_tokens"] = limit
            if limit and ran:
                longest = max(ran, key=lambda p: p["tokens"])
                res[name]["extrapolated_step_s"] = round(
                    longest["seconds"] * (limit / longest["tokens"]) ** 2, 1
                )
    ratios = [p["peak_over_prediction"] for c in CONFIGS for p in res[c]["points"]
              if "peak_over_prediction" in p]  # fmt: skip
    if ratios:
        res["peak_over_prediction"] = f"{min(ratios):.3f}-{max(ratios):.3f}"
    res["ok"] = bool(res.get("plain_max_tokens") and res.get("ac_chunked_max_tokens"))
    return res

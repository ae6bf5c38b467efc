"""Short measured runs of a layout on this machine's CPU ranks: step time, peak tensor
memory and model states, for ``--calibrate`` and the tables of docs/plan.md.

Each rank builds meshtrain's reference decoder, ``meshtrain.initialize`` with the
layout's own config (``Layout.config``: the config the planner would write), and runs
``train_batch`` on random tokens: one warm-up step (the optimizer allocates its states),
then ``steps`` timed steps, each started after a barrier; a step's time is the slowest
rank's. Beside the wall time each rank's CPU seconds (``time.process_time``) over the
same step: on a machine whose cores other processes share, a rank waits for a core and
wall time swings with their load, while CPU time is what the step costs a rank with a core
of its own (gloo's waits block rather than spin, so they cost no CPU time). Calibration
and the step-time table use the slowest rank's CPU seconds; wall seconds are reported too.

**Peak tensor memory on CPU.** There is no allocator statistic on CPU, so it is read from
the process: glibc is told to give every block of 64 KiB or more its own mapping
(``mallopt(M_MMAP_THRESHOLD, 65536)``, the setting ``benchmarks/bench_context_parallel.py``
uses), so freed large blocks leave the resident set and RSS follows the bytes alive; after
the warm-up the RSS high-water mark is reset (``/proc/self/clear_refs``) and the growth of
``VmHWM`` over the timed steps is the most bytes a step adds (activations, gradient
buckets, temporaries). Peak tensor memory = the model states the engine holds
(``engine.memory_report().measured``, exact) + that growth. Small blocks (< 64 KiB) stay in
the heap and are not seen; for the sizes measured they are well under 1% of the peak.
The interpreter, torch and meshtrain themselves (``rss_base``: the RSS before the model is
built) are the framework's overhead, reported apart.

**On a GPU** (a rank's device is CUDA: ``distributed.env`` gives each rank its
``LOCAL_RANK``'s GPU and NCCL): the step is timed in wall seconds between two
``torch.cuda.synchronize()`` (CPU seconds there are only the launches), peak tensor
memory is ``torch.cuda.max_memory_allocated()`` over the timed steps (the allocator's
own statistic: states included), and the framework's overhead is what the device holds
beyond the tensors after the steps (``mem_get_info``'s used bytes minus
``memory_allocated``: the CUDA context, NCCL's buffers and the allocator's reserve).
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

__all__ = ["build_model", "measure", "measure_rank"]

_M_MMAP_THRESHOLD = -3
PACKED_DOCUMENTS = 4  # documents per row of a packed layout's batches


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def build_model(model_cfg: dict[str, Any], meta: bool = False):
    """The model a measured run trains: meshtrain's Decoder from its config's fields, or
    with ``"hf": "llama" | "mixtral"`` a transformers model from the rest as its config
    (SDPA attention); ``meta``: on the meta device (the planner's copy)."""
    import contextlib

    import torch

    cfg = dict(model_cfg)
    family = cfg.pop("hf", None)
    with torch.device("meta") if meta else contextlib.nullcontext():
        if family is None:
            from meshtrain.models import Decoder, DecoderConfig

            return Decoder(DecoderConfig(**cfg))
        import transformers

        kind = {"llama": transformers.LlamaConfig, "mixtral": transformers.MixtralConfig}[family]
        config = kind(**cfg)
        config._attn_implementation = "sdpa"
        cls = {"llama": transformers.LlamaForCausalLM, "mixtral": transformers.MixtralForCausalLM}
        return cls[family](config)


def measure_rank(
    model_cfg: dict[str, Any],
    layout: dict[str, Any],
    seq: int,
    steps: int,
    precision: str,
    folder: str | None = None,
    zero_init: bool = False,
) -> dict[str, Any]:
    """Inside one rank: the figures of the module docstring for this rank; ``folder``: a
    ``save_pretrained`` folder of the model, loaded sliced (``meshtrain.from_pretrained``)
    instead of built in the process; ``zero_init``: built under ``meshtrain.zero.Init``."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 65536)
    except OSError:  # not glibc: RSS then lags the bytes alive (the figure says so)
        pass
    import torch
    import torch.distributed as dist

    import meshtrain
    from meshtrain.plan.layout import Layout

    torch.set_num_threads(1)
    rss_base = _status("VmRSS")
    x = Layout(**layout)
    config = x.config(precision)
    config["steps_per_print"] = 10**6
    torch.manual_seed(0)
    if folder is None:
        if zero_init:
            with meshtrain.zero.Init(config_dict_or_path=config):
                model = build_model(model_cfg)
        else:
            model = build_model(model_cfg)
        engine, *_ = meshtrain.initialize(model=model, config=config)
    else:
        engine, *_ = meshtrain.from_pretrained(folder, config)
    load_peak = _status("VmHWM") - rss_base  # building the model and initialize, host RAM
    if steps == 0:  # the load alone (plan.host_memory's table)
        return {"load_peak": load_peak, "rss_base": rss_base}
    g = torch.Generator().manual_seed(engine.topology.dp_rank)

    def batches():
        out = []
        for _ in range(x.grad_accum):
            ids = torch.randint(0, model_cfg["vocab_size"], (x.micro_batch, seq), generator=g)
            batch = {"input_ids": ids, "labels": ids}
            if x.packed:  # PACKED_DOCUMENTS documents a row: positions restart at each
                doc = -(-seq // PACKED_DOCUMENTS)
                pos = torch.arange(seq) % doc
                batch["position_ids"] = pos.expand(x.micro_batch, seq).contiguous()
                batch["labels"] = ids.masked_fill(pos.expand_as(ids) == 0, -100)
            out.append(batch)
        return iter(out)

    cuda = engine.device.type == "cuda"
    engine.train_batch(batches())  # warm-up: optimizer states allocated
    stats = engine.topology.stats
    wire0 = stats.sent_by_group()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = _reset_peak()
    times, cpu = [], []
    for _ in range(steps):
        data = batches()
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        engine.train_batch(data)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    growth = _status("VmHWM") - base
    device_peak = device_overhead = None
    if cuda:  # the module docstring's GPU figures
        device_peak = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        device_overhead = total - free - torch.cuda.memory_allocated()
    wire = {g: (v - wire0.get(g, 0.0)) / steps for g, v in stats.sent_by_group().items()}
    report = engine.memory_report()
    m = report.measured
    return {
        "times": times,
        "cpu": cpu,
        "growth": growth,
        "states": m.params + m.grads + m.optimizer,
        "formula_states": None if report.formula is None else report.formula.total,
        "rss_base": rss_base,
        "load_peak": load_peak,
        "wire": {g: v for g, v in wire.items() if v},
        "device_peak": device_peak,
        "device_overhead": device_overhead,
    }


def measure(
    model_cfg: dict[str, Any],
    layout,
    *,
    seq: int,
    steps: int = 3,
    precision: str = "fp32",
    timeout: float = 600.0,
    loading: str = "whole",
) -> dict[str, Any]:
    """Run ``layout`` on ``layout.world`` CPU ranks; the slowest rank's median step
    seconds (wall, ``step_s``, and CPU, ``cpu_s``), the largest rank's peak tensor bytes
    and model states, and every rank's host-RAM peak while loading (``load_peak``: the
    growth of ``VmHWM`` from before the model is built to after ``initialize``).
    ``steps=0``: only the load, returning ``{"load_peak"}``. ``loading`` (one of
    ``host_memory.LOADINGS``): ``sliced``, a transformers model is written once as a
    sharded ``save_pretrained`` folder (random values, in a temporary folder) and every
    rank loads its slices of it; ``zero-init``, built under ``meshtrain.zero.Init``."""
    import tempfile

    if loading == "sliced":
        with tempfile.TemporaryDirectory(prefix="meshtrain-plan-") as folder:
            model = build_model(model_cfg)
            model.config.architectures = [type(model).__name__]
            model.save_pretrained(folder, max_shard_size="100MB")
            del model
            return _measure(model_cfg, layout, seq, steps, precision, timeout, folder, False)
    zero_init = loading == "zero-init"
    return _measure(model_cfg, layout, seq, steps, precision, timeout, None, zero_init)


def _measure(
    model_cfg, layout, seq, steps, precision, timeout, folder, zero_init
) -> dict[str, Any]:
    import statistics

    from meshtrain.launch.processes import run_on_ranks

    # Fresh interpreters (spawn, not fork): a forked rank inherits its parent's heap and
    # garbage; frees of inherited memory during a step let new tensors land in pages
    # already resident, and the VmHWM growth then misses them (seen: 21 MB measured
    # against 34 MB predicted, forked late in the whole suite; within 10% run alone).
    ranks = run_on_ranks(
        measure_rank,
        layout.world,
        (model_cfg, layout.as_dict(), seq, steps, precision, folder, zero_init),
        timeout=timeout,
        start_method="spawn",
    )
    if steps == 0:
        return {"load_peak": max(r["load_peak"] for r in ranks)}
    per_step = [max(r["times"][i] for r in ranks) for i in range(steps)]
    cpu_step = [max(r["cpu"][i] for r in ranks) for i in range(steps)]
    on_gpu = ranks[0]["device_peak"] is not None
    if on_gpu:  # the allocator's statistic (module docstring)
        peak = max(r["device_peak"] for r in ranks)
    else:
        peak = max(r["states"] + r["growth"] for r in ranks)
    return {
        "device": "cuda" if on_gpu else "cpu",
        "step_s": statistics.median(per_step),
        "steps_s": per_step,
        "cpu_s": statistics.median(cpu_step),
        # what a step costs: CPU seconds on CPU ranks, wall seconds on a GPU
        "cost_s": statistics.median(per_step if on_gpu else cpu_step),
        "device_overhead": max(r["device_overhead"] or 0 for r in ranks) if on_gpu else None,
        "peak_tensor_bytes": peak,
        "states": max(r["states"] for r in ranks),
        "formula_states": max((r["formula_states"] or 0) for r in ranks),
        "rss_base": max(r["rss_base"] for r in ranks),
        "load_peak": max(r["load_peak"] for r in ranks),
        # bytes sent per step in each group, the largest rank's (the time model's wire)
        "wire": {g: max(r["wire"].get(g, 0.0) for r in ranks) for g in ranks[0]["wire"]},
    }

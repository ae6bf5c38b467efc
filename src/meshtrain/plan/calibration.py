"""Fitted constants of this machine, stored for later plans (``meshtrain plan --calibrate``).

``--calibrate`` runs a handful of layouts of a small reference decoder for a few steps on
CPU ranks (``measure.measure``) and fits, by least squares over the measured step times,

    t = compute / efficiency + wire_bytes / bandwidth + micro_step_s (m + p - 1)
        + optimizer_bytes / memory_bandwidth + step_s

(weighted by ``1 / measured``: relative error is what a plan is judged by) where
``compute`` is the step's FLOPs over the measured peak (bubble and oversubscribed
cores included, ``step_time``), ``wire_bytes`` every group's bytes per rank, ``optimizer_bytes`` what the optimizer step
reads and writes (``step_time``); on CPU ranks
(gloo through the loopback and shared memory) nothing overlaps reliably, so all bytes
count. A coefficient the fit makes negative is dropped (set to its floor) and the rest
refitted. The store is a JSON file, ``~/.cache/meshtrain/plan_calibration.json`` (or
``MESHTRAIN_PLAN_CALIBRATION``), keyed by machine and device: host name, CPU model and
core count for CPU ranks; host name, the GPU's name and count for a GPU
(``--calibrate --gpu H100``); ``meshtrain plan --gpu cpu`` (or ``--gpu H100`` on that
machine) reads it.

On a GPU the fit replaces the efficiency, the per-micro-step and per-step costs, the
memory bandwidth the optimizer step reaches and the framework's own device memory
(``overhead_bytes``, measured); the link between GPUs only when a multi-GPU layout was
measured (one GPU has none to fit), and the link between nodes never (calibration runs
on one node): those keep the data sheet's figures.
"""

from __future__ import annotations

import json
import os
import platform
import socket
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from meshtrain.files.atomic import write_atomic
from meshtrain.plan.hardware import Hardware

__all__ = ["Calibration"]

ENV = "MESHTRAIN_PLAN_CALIBRATION"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@dataclass(frozen=True)
class Calibration:
    """What ``--calibrate`` fitted on one machine, and the runs it fitted them on."""

    machine: str
    efficiency: float
    bw_intra: float  # bytes/s
    micro_step_s: float
    step_s: float
    peak_flops: float
    hbm: float = 10e9  # bytes/s the optimizer step reaches
    rss_base: int = 0  # the framework's own resident memory per rank (interpreter, torch)
    device: str = "cpu"  # "cpu", or the GPU's name in hardware.GPUS
    overhead_bytes: int | None = None  # a GPU's measured memory beyond the tensors
    links_fitted: bool = True  # whether a multi-rank layout measured the link
    date: str = ""
    load_avg: str = ""  # `uptime`'s load averages while measuring
    samples: list = field(default_factory=list)

    @staticmethod
    def machine_key(device: str = "cpu") -> str:
        if device == "cpu":
            return f"{socket.gethostname()}|{_cpu_model()}|{os.cpu_count()}"
        import torch

        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
        return f"{socket.gethostname()}|{device}|{name}|{torch.cuda.device_count()}"

    @staticmethod
    def path() -> Path:
        return Path(
            os.environ.get(ENV) or Path.home() / ".cache" / "meshtrain" / "plan_calibration.json"
        )

    def apply(self, hw: Hardware) -> Hardware:
        """``hw`` with the fitted constants (module docstring: which ones on a GPU)."""
        gpu = self.device != "cpu"
        intra = self.bw_intra if self.links_fitted else hw.bw_intra
        return replace(
            hw,
            efficiency=self.efficiency,
            bw_intra=intra,
            bw_inter=hw.bw_inter if gpu else self.bw_intra,
            micro_step_s=self.micro_step_s,
            step_s=self.step_s,
            hbm=self.hbm,
            peak_flops=self.peak_flops,
            overhead_bytes=hw.overhead_bytes
            if self.overhead_bytes is None
            else self.overhead_bytes,
            source=f"calibrated on this machine {self.date} (load {self.load_avg})",
        )

    def save(self, path: Path | None = None) -> Path:
        path = Path(path or self.path())
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {}
        if path.exists():
            try:
                data = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                data = {}
        data[self.machine] = asdict(self)
        write_atomic(path, json.dumps(data, indent=1))
        return path

    @classmethod
    def load(cls, path: Path | None = None, device: str = "cpu") -> Calibration | None:
        """This machine's stored calibration of ``device``, or None."""
        path = Path(path or cls.path())
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        entry = data.get(cls.machine_key(device))
        return None if entry is None else cls(**entry)

    @classmethod
    def fit(cls, rows: list[dict], peak_flops: float, device: str = "cpu", **meta) -> Calibration:
        """Least squares over ``rows`` of ``{"compute", "wire", "slots", "optimizer",
        "measured"}``
        (module docstring)."""
        import numpy as np

        names = ["compute", "wire", "slots", "optimizer", "one"]
        x = np.array(
            [[r["compute"], r["wire"], r["slots"], r.get("optimizer", 0.0), 1.0] for r in rows],
            dtype=float,
        )
        y = np.array([r["measured"] for r in rows], dtype=float)
        # relative errors are what the plan is judged by: weight each row by 1 / measured
        x, y = x / y[:, None], np.ones_like(y)
        keep = list(range(len(names)))
        coef = np.zeros(len(names))
        for _ in range(len(names)):
            sol, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
            coef = np.zeros(len(names))
            coef[keep] = sol
            negative = [i for i in keep if coef[i] < 0]
            if not negative:
                break
            keep = [i for i in keep if i not in negative]
        inv_eff, inv_bw, slot, inv_hbm, one = (float(c) for c in coef)
        return cls(
            machine=cls.machine_key(device),
            device=device,
            efficiency=1.0 / inv_eff if inv_eff > 0 else 1.0,
            bw_intra=1.0 / inv_bw if inv_bw > 0 else 1e12,
            micro_step_s=max(0.0, slot),
            step_s=max(0.0, one),
            peak_flops=peak_flops,
            hbm=1.0 / inv_hbm if inv_hbm > 0 else 1e15,
            samples=rows,
            **meta,
        )

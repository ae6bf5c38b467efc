"""The device a plan is for: peak FLOP/s, memory, link bandwidths, and where each figure
comes from.

Data-sheet constants (dense, no 2:4 sparsity, per device). Peak bf16 FLOP/s are the ones
``meshtrain.engine.flops`` uses for MFU (NVIDIA's data sheets), so a plan's MFU and a
run's MFU divide by the same number::

    GPU    bf16 TFLOP/s  memory       NVLink / node   inter-node (per GPU)   HBM
    H100   989.4         80 GB HBM3   450 GB/s        50 GB/s (400G IB)      3.35 TB/s
    H200   989.4         141 GB HBM3e 450 GB/s        50 GB/s (400G IB)      4.8 TB/s
    A100   312           80 GB HBM2e  300 GB/s        25 GB/s (200G IB)      2.04 TB/s
    L40S   362.05        48 GB GDDR6  32 GB/s (PCIe)  25 GB/s (200G)         0.864 TB/s
    B200   2250          180 GB HBM3e 900 GB/s        50 GB/s (400G IB)      8 TB/s

Sources: NVIDIA H100 Tensor Core GPU data sheet (SXM5: 989.4 bf16 dense, 80 GB,
3.35 TB/s, NVLink 900 GB/s bidirectional = 450 GB/s each way); H200 data sheet (141 GB,
4.8 TB/s, same tensor cores as H100); A100 data sheet (SXM4 80GB: 312 bf16, 2,039 GB/s,
NVLink 600 GB/s bidirectional); L40S data sheet (362.05 bf16 dense, 48 GB, 864 GB/s, PCIe
Gen4 x16 64 GB/s bidirectional); DGX B200 / HGX B200 (2.25 PFLOP/s dense bf16 per GPU,
180 GB, 8 TB/s, NVLink 5 1.8 TB/s bidirectional). Inter-node: one ConnectX-7 400 Gb/s NIC
per GPU (DGX H100/H200/B200 reference design) = 50 GB/s; 200 Gb/s HDR for A100/L40S.
Memory is what CUDA sees (nvidia-smi's total: H100 SXM 81,559 MiB, H200 143,771 MiB,
A100 80GB 81,920 MiB, L40S 46,068 MiB; B200: the data sheet's 180 GB).
``--bw-intra`` / ``--bw-inter`` override the links; ``--calibrate`` replaces the
efficiency and bandwidth by fitted ones for the machine at hand.

The *efficiency* (the fraction of peak a training step's matmuls reach) is not on any
data sheet: 0.5 is the default for a named GPU, from the published runs (torchtitan
Llama-3-8B on 8 H100s, 6,667 tokens/s per GPU, is ~39% MFU with attention, ~47% of
peak in its matmuls); ``cpu`` measures this process's peak (``engine.flops``) and takes
its efficiency from ``--calibrate`` (0.6 until calibrated).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from meshtrain.errors import ConfigError

__all__ = ["GPUS", "Hardware"]

GiB = 1 << 30

# name -> (bf16 peak FLOP/s, memory bytes, intra GB/s, inter GB/s, HBM GB/s, PCIe GB/s)
# memory: what the device reports to CUDA (nvidia-smi's MiB), below the marketing GB
MiB = 1 << 20
GPUS: dict[str, tuple[float, int, float, float, float, float]] = {
    "H100": (989.4e12, 81559 * MiB, 450.0, 50.0, 3350.0, 64.0),
    "H200": (989.4e12, 143771 * MiB, 450.0, 50.0, 4800.0, 64.0),
    "A100": (312.0e12, 81920 * MiB, 300.0, 25.0, 2039.0, 32.0),
    "L40S": (362.05e12, 46068 * MiB, 32.0, 25.0, 864.0, 32.0),
    "B200": (2250.0e12, 180 * 10**9, 900.0, 50.0, 8000.0, 64.0),
}
SOURCE = "NVIDIA data sheet (see meshtrain.plan.hardware)"
# CUDA context, NCCL's channel buffers and the caching allocator's reserve: an assumed
# figure (the torch CUDA context alone is ~0.5 GiB on Hopper), replaced by --calibrate
GPU_OVERHEAD_BYTES = 2 * GiB
# Host RAM the CUDA runtime keeps per process beside the code (plan.host_memory): an
# assumed 1 GiB, not measured (no GPU on the machine this was written on); CPU ranks: none.
GPU_HOST_OVERHEAD_BYTES = GiB


@dataclass(frozen=True)
class Hardware:
    """One device kind and its links. Bandwidths in bytes/s, FLOP/s dense."""

    name: str
    peak_flops: float
    memory_bytes: int
    bw_intra: float  # between devices of one node (NVLink; CPU ranks: shared memory / gloo)
    bw_inter: float  # between nodes, per device
    hbm: float  # device memory bandwidth (the optimizer step is memory-bound)
    host_link: float  # host <-> device (offload)
    efficiency: float = 0.5  # fraction of peak a step's matmuls reach
    overhead_bytes: int = GPU_OVERHEAD_BYTES  # the framework's own memory per device
    host_overhead_bytes: int = GPU_HOST_OVERHEAD_BYTES  # the device runtime's host RAM
    micro_step_s: float = 0.0  # fixed seconds per micro-step (Python, launches)
    step_s: float = 0.0  # fixed seconds per optimizer step
    gpus_per_node: int = 8
    cores: int = 0  # CPU only: cores the ranks share (0: one per rank)
    source: str = SOURCE

    @classmethod
    def named(cls, name: str, *, gpus_per_node: int = 8) -> Hardware:
        """The data-sheet device ``name`` (H100, H200, A100, L40S, B200) or ``cpu``."""
        key = str(name).upper()
        if key == "CPU":
            return cls.cpu()
        if key not in GPUS:
            raise ConfigError(
                f"--gpu: unknown GPU {name!r}; known: {', '.join(GPUS)}, cpu (or give "
                "--calibrate on the machine to measure it)"
            )
        peak, mem, intra, inter, hbm, pcie = GPUS[key]
        return cls(
            name=key,
            peak_flops=peak,
            memory_bytes=mem,
            bw_intra=intra * 1e9,
            bw_inter=inter * 1e9,
            hbm=hbm * 1e9,
            host_link=pcie * 1e9,
            gpus_per_node=gpus_per_node,
        )

    @classmethod
    def cpu(cls) -> Hardware:
        """CPU ranks of this machine (gloo): the peak measured here, one thread per rank."""
        import torch

        from meshtrain.engine.flops import measure_cpu_peak

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a rank runs one thread (the launcher's default)
        try:
            peak = measure_cpu_peak()
        finally:
            torch.set_num_threads(threads)
        total = _host_memory()
        return cls(
            name="cpu",
            peak_flops=peak,
            memory_bytes=total,
            bw_intra=2e9,
            bw_inter=1e9,
            hbm=10e9,
            host_link=10e9,
            efficiency=0.6,
            overhead_bytes=0,
            host_overhead_bytes=0,
            micro_step_s=0.01,
            step_s=0.01,
            gpus_per_node=os.cpu_count() or 1,
            cores=os.cpu_count() or 1,
            source="measured fp32 matmul peak, one thread (engine.flops); links assumed",
        )

    def with_links(self, bw_intra: float | None, bw_inter: float | None) -> Hardware:
        """These links in GB/s where given (``--bw-intra`` / ``--bw-inter``)."""
        for flag, value in (("--bw-intra", bw_intra), ("--bw-inter", bw_inter)):
            if value is not None and not value > 0:
                raise ConfigError(f"{flag}: must be a bandwidth > 0 in GB/s, got {value}")
        return replace(
            self,
            bw_intra=self.bw_intra if bw_intra is None else bw_intra * 1e9,
            bw_inter=self.bw_inter if bw_inter is None else bw_inter * 1e9,
        )

    def slowdown(self, ranks_per_node: int) -> float:
        """How much slower each rank computes when the ranks outnumber the cores (CPU)."""
        if not self.cores:
            return 1.0
        return max(1.0, ranks_per_node / self.cores)


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 * GiB

"""Where this process sits, as ``TrainingArguments`` answers it: transformers' ``device``,
``n_gpu``, ``parallel_mode``, ``world_size``, ``process_index``, ``local_process_index``,
``should_log``, ``should_save``, ``get_process_log_level`` and ``main_process_first``.

transformers answers from accelerate's ``PartialState`` (which joins the process group on
first use); meshtrain answers from the launcher's environment (``distributed.env``), so
asking where a process is never joins a group nor draws from a random stream. Only
``main_process_first`` with several processes communicates: it joins the default group
(what the engine later joins too, ``init_distributed`` being idempotent) and holds every
process but the main one at a barrier until the main one has done its work.

Differences, on purpose: ``n_gpu`` is 1 on a CUDA process and 0 on CPU (meshtrain runs one
device per process and never ``nn.DataParallel``, which is what transformers' ``n_gpu > 1``
means). ``use_cpu=True`` on a machine with CUDA is refused by ``TrainingArguments`` (the
engine places every process by the launcher's environment).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum

import torch

from meshtrain.distributed.env import DistEnv, read_env

# transformers.trainer_utils / training_args: log level names ("passive": leave as set)
LOG_LEVELS = {
    "detail": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "passive": -1,
}


class ParallelMode(Enum):
    """transformers' ``ParallelMode`` values (``parallel_mode.value == "distributed"`` is
    what its example scripts print)."""

    NOT_PARALLEL = "not_parallel"
    NOT_DISTRIBUTED = "not_distributed"
    DISTRIBUTED = "distributed"
    SAGEMAKER_MODEL_PARALLEL = "sagemaker_model_parallel"
    SAGEMAKER_DATA_PARALLEL = "sagemaker_data_parallel"
    TPU = "tpu"


def place() -> DistEnv:
    """This process's rank, world and local rank from the launcher's environment."""
    return read_env()


def device(use_cpu: bool) -> torch.device:
    """The device the engine will put this process on."""
    if use_cpu or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        return torch.device("cpu")
    return place().device


def parallel_mode() -> ParallelMode:
    """DISTRIBUTED with several processes, else NOT_PARALLEL (no DataParallel here)."""
    return ParallelMode.DISTRIBUTED if place().world_size > 1 else ParallelMode.NOT_PARALLEL


def library_verbosity() -> int:
    """transformers' ``logging.get_verbosity()`` when transformers is loaded (a script that
    sets its verbosity has imported it), else its default, WARNING."""
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        return hf_logging.get_verbosity()
    return logging.WARNING


def process_log_level(main_level: str, replica_level: str, should_log: bool) -> int:
    """transformers' ``get_process_log_level``: the main process's level or the replicas',
    "passive" meaning the library's verbosity as it stands."""
    chosen = LOG_LEVELS[main_level if should_log else replica_level]
    return library_verbosity() if chosen == -1 else chosen


@contextmanager
def main_process_first(local: bool = True) -> Iterator[None]:
    """The main process (of this node with ``local``, else rank 0) runs the body first; the
    others wait at a barrier, then run it (reading what the main one cached)."""
    env = place()
    if env.world_size == 1:
        yield
        return
    from meshtrain.distributed.env import init_distributed

    init_distributed()
    main = (env.local_rank if local else env.rank) == 0
    try:
        if not main:
            torch.distributed.barrier()
        yield
    finally:
        if main:
            torch.distributed.barrier()


__all__ = [
    "LOG_LEVELS",
    "ParallelMode",
    "device",
    "library_verbosity",
    "main_process_first",
    "parallel_mode",
    "place",
    "process_log_level",
]

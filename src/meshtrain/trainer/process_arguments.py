"""``TrainingArguments``' fields about processes, logging and the Hub, and transformers'
properties of where this process is (``device``, ``n_gpu``, ``parallel_mode``,
``world_size``, ``process_index``, ``local_process_index``, ``should_log``,
``should_save``, ``get_process_log_level``, ``main_process_first``), read from the
launcher's environment by ``trainer.processes``.

A dataclass of its own so ``arguments.py`` keeps to the training fields and their engine
config; its fields are keyword-only, so ``TrainingArguments("out")`` still binds
``output_dir`` first, as in transformers. ``push_to_hub=True`` is refused (meshtrain never
uploads), ``eval_do_concat_batches=False`` is refused (not implemented), and ``use_cpu``
on a machine with CUDA is refused with the way to hide the GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshtrain.errors import ConfigError
from meshtrain.trainer import processes
from meshtrain.trainer.checks import choice

LOG_LEVELS = tuple(processes.LOG_LEVELS)


@dataclass(kw_only=True)
class ProcessArguments:
    """transformers' process, logging and Hub arguments (module docstring)."""

    use_cpu: bool = False
    """transformers': train on CPU. meshtrain places processes by the launcher's
    environment, so on a machine with CUDA it is refused (hide the GPUs instead)."""
    local_rank: int = -1  # torch.distributed.launch's --local_rank; the environment wins
    log_level: str = "passive"
    log_level_replica: str = "warning"
    log_on_each_node: bool = True
    save_on_each_node: bool = False
    eval_do_concat_batches: bool = True
    push_to_hub: bool = False
    """transformers' upload to the Hub: refused when True (meshtrain never uploads)."""
    hub_model_id: str | None = None
    hub_strategy: str = "every_save"
    hub_token: str | None = None
    hub_private_repo: bool | None = None
    hub_always_push: bool = False
    hub_revision: str | None = None

    def check_process_fields(self) -> None:
        """The fields' values (called by ``TrainingArguments.__post_init__``)."""
        for name in ("log_level", "log_level_replica"):
            setattr(self, name, choice(name, getattr(self, name), LOG_LEVELS))
        if self.push_to_hub:
            raise ConfigError(
                "TrainingArguments.push_to_hub=True: meshtrain does not upload to the Hugging "
                "Face Hub (training runs offline); leave it False and upload output_dir "
                "yourself afterwards (`hf upload <repo> <output_dir>`)"
            )
        if not self.eval_do_concat_batches:
            raise ConfigError(
                "TrainingArguments.eval_do_concat_batches=False is not implemented: "
                "evaluation hands compute_metrics the predictions of every batch "
                "concatenated (the default True); leave it True"
            )
        if self.use_cpu and torch.cuda.is_available():
            raise ConfigError(
                "TrainingArguments.use_cpu=True on a machine with CUDA: meshtrain places "
                "each process by the launcher's environment; hide the GPUs with "
                "CUDA_VISIBLE_DEVICES='' to train on CPU"
            )

    @property
    def device(self) -> torch.device:
        """The device this process trains on."""
        return processes.device(self.use_cpu)

    @property
    def n_gpu(self) -> int:
        """GPUs this process uses: 1 on CUDA, 0 on CPU (never DataParallel)."""
        return 0 if self.device.type == "cpu" else 1

    @property
    def parallel_mode(self) -> processes.ParallelMode:
        return processes.parallel_mode()

    @property
    def world_size(self) -> int:
        return processes.place().world_size

    @property
    def process_index(self) -> int:
        return processes.place().rank

    @property
    def local_process_index(self) -> int:
        return processes.place().local_rank

    @property
    def should_log(self) -> bool:
        """Whether this process logs: local rank 0 (``log_on_each_node``) or rank 0."""
        index = self.local_process_index if self.log_on_each_node else self.process_index
        return index == 0

    @property
    def should_save(self) -> bool:
        index = self.local_process_index if self.save_on_each_node else self.process_index
        return index == 0

    @property
    def train_batch_size(self) -> int:
        return self.per_device_train_batch_size * max(1, self.n_gpu)

    @property
    def eval_batch_size(self) -> int:
        return self.per_device_eval_batch_size * max(1, self.n_gpu)

    def get_process_log_level(self) -> int:
        """``log_level`` on the process that logs, ``log_level_replica`` elsewhere
        ("passive": transformers' verbosity as it stands)."""
        return processes.process_log_level(self.log_level, self.log_level_replica, self.should_log)

    def main_process_first(self, local: bool = True, desc: str = "work"):
        """Context manager: the main process runs the body first, the others after it
        (``datasets.map`` caching); see ``trainer.processes``."""
        return processes.main_process_first(local)


__all__ = ["LOG_LEVELS", "ProcessArguments"]

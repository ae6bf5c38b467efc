"""The one set-up path every front door takes: join the process group, build the mesh,
build the Engine.

::

    meshtrain.initialize(model=..., config=...)   engine/initialize.py      start_engine
    Accelerator(config=...)                        accelerate/accelerator.py join_mesh
      .prepare(model, optimizer, loader)                                     start_engine
    Trainer(model, args).train()                   trainer/setup.py          join_mesh, then
                                                                             initialize
    meshtrain train                                a Trainer client

``join_mesh`` joins the default process group with the config's ``distributed.backend``
and ``distributed.timeout_minutes`` (``first_step_timeout_minutes`` until the first step
ends; a no-op when the group exists: the first join of a
process wins) and builds the ``Topology`` its ``mesh`` section describes. ``start_engine``
joins unless it is handed that Topology, resolves the config's "auto" values and batch
sizes for the data-parallel size, warns once (rank 0) about every key that is accepted
and ignored, deals the training data over dp, and builds the Engine. A front door that
needs the device before it has a model (the Accelerator, the Trainer's batch arithmetic)
calls ``join_mesh`` first and hands the Topology on, so every door passes both halves.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch import nn

from meshtrain.config import Config, load_config
from meshtrain.distributed.env import join_group
from meshtrain.distributed.topology import Topology
from meshtrain.engine.engine import Engine

log = logging.getLogger("meshtrain")

# all that joining and the mesh read (tensor_parallel.autotp_size is DeepSpeed's name for
# mesh.tensor_parallel_size)
_JOIN_SECTIONS = ("distributed", "mesh", "tensor_parallel")


def join_mesh(config: Config | Mapping[str, Any]) -> Topology:
    """Join the process group (``distributed.backend``, ``distributed.timeout_minutes``)
    and build the Topology of ``mesh``. ``config``: a Config, or a config dict of which
    only the ``distributed``, ``mesh`` and ``tensor_parallel`` sections are read (and
    validated: a mesh dimension that is not built raises ConfigError here, before any
    process group)."""
    if not isinstance(config, Config):
        config = load_config({k: config[k] for k in _JOIN_SECTIONS if k in config})
    join_group(config.distributed)
    mesh = config.mesh
    return Topology(
        pp=mesh.pipeline_parallel_size,
        tp=mesh.tensor_parallel_size,
        cp=mesh.context_parallel_size,
        ep=mesh.expert_parallel_size,
    )


def start_engine(
    model: nn.Module,
    config: Config,
    *,
    topology: Topology | None = None,
    model_parameters=None,
    optimizer=None,
    lr_scheduler=None,
    training_data=None,
    collate_fn=None,
    tp_plan=None,
) -> Engine:
    """The Engine for ``model`` under ``config``: joins and builds the mesh unless
    ``topology`` is given (see the module docstring). ``training_data``: a dataset, dealt
    over dp in ``train_micro_batch_size_per_gpu`` batches, or a ResumableDataLoader used
    as it is; the engine's ``training_dataloader`` is that loader (None without data)."""
    from meshtrain.config.ignored import warn_ignored
    from meshtrain.data.loader import ResumableDataLoader

    if topology is None:
        topology = join_mesh(config)
    cfg = config.resolve_auto_defaults().resolve_batch_sizes(topology.dp_size)
    if topology.layout.world_size > 1:  # a node with another config or install: refused here
        _refuse_other_jobs(cfg, topology)
    if topology.rank == 0:
        warn_ignored(cfg, log)
    loader = training_data if isinstance(training_data, ResumableDataLoader) else None
    if training_data is not None and loader is None:
        loader = ResumableDataLoader(
            training_data,
            cfg.train_micro_batch_size_per_gpu,
            num_replicas=topology.dp_size,
            rank=topology.dp_rank,
            collate_fn=collate_fn,
        )
    return Engine(
        model, cfg, topology, model_parameters, optimizer, lr_scheduler, loader, tp_plan=tp_plan
    )


def _refuse_other_jobs(cfg: Config, topology: Topology) -> None:
    import torch.distributed as dist

    from meshtrain import __version__
    from meshtrain.engine.agreement import check_same_job

    store = dist.distributed_c10d._get_default_store()
    check_same_job(
        cfg.model_dump(mode="json"), __version__, topology.rank, topology.layout.world_size, store
    )


__all__ = ["join_mesh", "start_engine"]

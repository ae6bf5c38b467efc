"""``meshtrain.initialize``: the DeepSpeed-shaped entry point, and ``add_config_arguments``.

Scripts written for DeepSpeed port with an import change::

    parser = argparse.ArgumentParser()
    parser = meshtrain.add_config_arguments(parser)      # --deepspeed, --deepspeed_config
    args = parser.parse_args()
    engine, optimizer, dataloader, lr_scheduler = meshtrain.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset)
    for batch in dataloader:
        loss = engine(**batch)   # module(**batch); engine(batch) is module(batch)
        engine.backward(loss)
        engine.step()        # acts only at the gradient-accumulation boundary
"""

from __future__ import annotations

import argparse

from torch import nn

from meshtrain.distributed.topology import Topology
from meshtrain.errors import ConfigError


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line flags to ``parser`` and return it: ``--deepspeed``,
    ``--deepspeed_config PATH`` and the old ``--deepscale`` / ``--deepscale_config``."""
    group = parser.add_argument_group("meshtrain", "DeepSpeed-compatible configuration")
    group.add_argument(
        "--deepspeed", default=False, action="store_true", help="enable the engine (accepted)"
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="JSON/YAML config path")
    group.add_argument(
        "--deepscale", default=False, action="store_true", help="old name of --deepspeed"
    )
    group.add_argument(
        "--deepscale_config", default=None, type=str, help="old name of --deepspeed_config"
    )
    return parser


def _config_from_args(args) -> str | None:
    if args is None:
        return None
    path = getattr(args, "deepspeed_config", None)
    return path if path is not None else getattr(args, "deepscale_config", None)


def _choose_config(config, config_params, args):
    """The one config source; ConfigError when two disagree (naming both)."""
    from meshtrain.config import load_config

    given = [
        (n, c) for n, c in (("config", config), ("config_params", config_params)) if c is not None
    ]
    from_args = _config_from_args(args)
    if from_args is not None:
        given.append(("args.deepspeed_config", from_args))
    if not given:
        raise ConfigError(
            "config: meshtrain.initialize needs a config: pass config= (dict, JSON/YAML path "
            "or Config), or args= from a parser given --deepspeed_config PATH "
            "(meshtrain.add_config_arguments adds the flag)"
        )
    loaded = [(name, load_config(c)) for name, c in given]
    first_name, first = loaded[0]
    for name, other in loaded[1:]:
        if other != first:
            raise ConfigError(
                f"config: {first_name} and {name} are both given and differ; pass one of them"
                f" ({name} = {given[[n for n, _ in given].index(name)][1]!r})"
            )
    return first


def initialize(
    model: nn.Module | None = None,
    model_parameters=None,
    config=None,
    training_data=None,
    collate_fn=None,
    optimizer=None,
    lr_scheduler=None,
    topology: Topology | None = None,
    *,
    args=None,
    config_params=None,
    dist_init_required: bool | None = None,
    mpu=None,
    tp_plan=None,
):
    """DeepSpeed-style entry: returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    The config comes from ``config`` (a dict, a JSON/YAML path or a ``Config``),
    ``config_params`` or ``args.deepspeed_config``; giving two that differ is an error.
    ``topology`` defaults to the mesh the config's ``mesh`` section describes over the
    whole world; the process group is always joined (``dist_init_required`` is accepted
    for DeepSpeed scripts and changes nothing). ``dataloader`` is None unless
    ``training_data`` is given; it deals disjoint shards to data-parallel ranks with ``train_micro_batch_size_per_gpu``
    samples per batch, and its position is saved with the engine's checkpoints. A
    ``meshtrain.data.ResumableDataLoader`` given as ``training_data`` is used as it is.
    ``tp_plan``: a tensor-parallel plan (``meshtrain.parallel.tensor.TPPlan``) for a model
    without a built-in one, used when ``mesh.tensor_parallel_size`` > 1.
    """
    from meshtrain.engine.start import start_engine

    if model is None:
        raise ConfigError("model: meshtrain.initialize needs model= (a torch.nn.Module)")
    if mpu is not None:  # DeepSpeed's Megatron model-parallel unit
        raise ConfigError(
            "mpu: meshtrain does not take a model-parallel unit; describe the layout in the "
            "config's mesh section (mesh.tensor_parallel_size, mesh.pipeline_parallel_size)"
        )
    cfg = _choose_config(config, config_params, args)
    engine = start_engine(
        model,
        cfg,
        topology=topology,
        model_parameters=model_parameters,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        training_data=training_data,
        collate_fn=collate_fn,
        tp_plan=tp_plan,
    )
    loader = engine.training_dataloader
    return engine, engine.optimizer, loader, engine.lr_scheduler


__all__ = ["add_config_arguments", "initialize"]

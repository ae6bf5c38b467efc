"""How a Trainer gets its engine: process group, mesh, the resumable training loader,
the learning-rate schedule, transformers' weight-decay groups, and the default collator
and column filtering of transformers' Trainer."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn


def default_collator(tokenizer: Any) -> Callable:
    if tokenizer is not None and hasattr(tokenizer, "pad"):
        from transformers import DataCollatorWithPadding

        return DataCollatorWithPadding(tokenizer)

    def collate(features: list[Any]) -> Any:
        if features and isinstance(features[0], Mapping):
            from transformers import default_data_collator

            return default_data_collator(features)
        return torch.utils.data.default_collate(features)

    return collate


def prepare_dataset(trainer, dataset: Any) -> Any:
    """transformers' ``remove_unused_columns`` for ``datasets.Dataset``."""
    if not trainer.args.remove_unused_columns or not hasattr(dataset, "column_names"):
        return dataset
    if trainer._forward_names is None:
        return dataset
    keep = set(trainer._forward_names) | set(trainer.label_names) | {"label", "label_ids"}
    unused = [c for c in dataset.column_names if c not in keep]
    return dataset.remove_columns(unused) if unused else dataset


def build_engine(trainer) -> None:
    """Process group, mesh, training loader, schedule and engine, once per Trainer."""
    if trainer.engine is not None:
        return
    import meshtrain
    from meshtrain.data.loader import ResumableDataLoader
    from meshtrain.distributed.env import read_env
    from meshtrain.engine.start import join_mesh

    args = trainer.args
    # the one set-up path (engine/start.py): the process group from the config's
    # distributed section, the mesh from its mesh section (deepspeed= and mesh= merged)
    topology = join_mesh(args.to_engine_config(world_size=read_env().world_size))
    trainer.topology = topology
    trainer.state.is_world_process_zero = topology.rank == 0
    trainer.state.is_local_process_zero = int(os.environ.get("LOCAL_RANK", "0")) == 0
    dp, gas = topology.dp_size, args.gradient_accumulation_steps
    loader = None
    if trainer.train_dataset is not None:
        trainer.train_dataset = trainer._prepare_dataset(trainer.train_dataset)
        loader = ResumableDataLoader(
            trainer.train_dataset,
            args.per_device_train_batch_size,
            num_replicas=dp,
            rank=topology.dp_rank,
            shuffle=True,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            collate_fn=trainer.data_collator,
            drop_last=args.dataloader_drop_last,
            num_workers=args.dataloader_num_workers,
        )
        trainer.steps_per_epoch = max(1, math.ceil(len(loader) / gas))
    else:
        trainer.steps_per_epoch = 1
    if args.max_steps > 0:
        trainer.max_steps = args.max_steps
    else:
        trainer.max_steps = max(1, math.ceil(args.num_train_epochs * trainer.steps_per_epoch))
    trainer.num_epochs = math.ceil(trainer.max_steps / trainer.steps_per_epoch)
    config = args.to_engine_config(total_steps=trainer.max_steps, world_size=topology.world_size)
    scheduler = trainer.lr_scheduler
    if scheduler is None and "scheduler" not in config:
        from meshtrain.optim.lr_scheduler_types import scheduler_factory

        warmup = args.warmup_for(trainer.max_steps)
        scheduler = scheduler_factory(args.lr_scheduler_type, warmup, trainer.max_steps)
    trainer.num_parameters = sum(
        p.numel()
        for p in {id(p): p for p in trainer.model.parameters()}.values()
        if p.requires_grad
    )
    if topology.pp_size > 1:
        from meshtrain.trainer.pipeline_step import check

        check(trainer)
    trainer.engine, _, _, _ = meshtrain.initialize(
        model=trainer.model,
        training_data=loader,  # its position goes into checkpoints
        model_parameters=param_groups(trainer.model),
        config=config,
        optimizer=trainer.optimizer,
        lr_scheduler=scheduler,
        topology=topology,
    )
    trainer.train_dataloader = loader
    from meshtrain.trainer.evaluation import vocab_gatherer

    trainer._gather_vocab = vocab_gatherer(trainer)
    trainer.optimizer = trainer.engine.optimizer
    trainer.lr_scheduler = trainer.engine.lr_scheduler


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """transformers' weight-decay split: no decay for biases and normalisation weights."""
    decay, no_decay = [], []
    for module in model.modules():
        norm = (
            isinstance(module, nn.LayerNorm | nn.GroupNorm)
            or "norm" in type(module).__name__.lower()
        )
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            (no_decay if norm or name == "bias" else decay).append(p)
    # the decay group takes the optimizer's weight_decay (weight_decay, or the one a
    # deepspeed= config's optimizer section sets)
    groups: list[dict[str, Any]] = [{"params": decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


__all__ = ["build_engine", "default_collator", "param_groups", "prepare_dataset"]

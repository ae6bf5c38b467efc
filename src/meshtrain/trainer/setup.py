"""How a Trainer gets its engine: process group, mesh, the resumable training loader,
the learning-rate schedule, transformers' weight-decay groups, and the default collator
and column filtering of transformers' Trainer."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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


def apply_use_cache(model: nn.Module, use_cache: bool) -> None:
    """``model.config.use_cache = use_cache``, as transformers' Trainer does: no cache in
    training (a cache also switches off transformers' packed-document mask)."""
    if hasattr(getattr(model, "config", None), "use_cache"):
        model.config.use_cache = use_cache


def choose_collator(collator: Callable | None, tokenizer: Any, padding_free: bool) -> Callable:
    """The Trainer's collator: the user's; with ``padding_free`` (TRL's name) the
    flattening collator, and a user's collator only when it flattens too (TRL refuses a
    custom collator with ``padding_free`` for the same reason: a padding collator would
    silently undo it)."""
    if not padding_free:
        return collator or default_collator(tokenizer)
    from meshtrain.data.packing import FlatteningCollator

    if collator is None:
        return FlatteningCollator()
    if not isinstance(collator, FlatteningCollator) and (
        type(collator).__name__ != "DataCollatorWithFlattening"
    ):
        from meshtrain.errors import ConfigError

        raise ConfigError(
            f"TrainingArguments.padding_free=True with data_collator={type(collator).__name__}: "
            "padding-free training needs a collator that flattens the batch; drop "
            "data_collator (meshtrain uses FlatteningCollator), pass transformers' "
            "DataCollatorWithFlattening, or set padding_free=False"
        )
    return collator


def signature_columns(model: Any) -> tuple[str, ...] | None:
    """The columns transformers' ``remove_unused_columns`` keeps for ``model``: the names
    of its forward's parameters (``_set_signature_columns_if_needed``; of the base model
    under peft). A forward that also takes ``**kwargs`` keeps only its named ones, as
    there: a masked-LM dataset's ``special_tokens_mask`` is dropped before the collator,
    which then finds the special tokens itself. None when the forward has no signature."""
    import inspect

    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    try:
        return tuple(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError, AttributeError):
        return None


def prepare_dataset(
    dataset: Any, args: Any, columns: tuple[str, ...] | None, label_names: list[str]
) -> Any:
    """transformers' ``remove_unused_columns`` for ``datasets.Dataset``: keep ``columns``
    (``signature_columns``), the label names, ``label`` and ``label_ids``."""
    if not args.remove_unused_columns or not hasattr(dataset, "column_names"):
        return dataset
    if columns is None:
        return dataset
    keep = set(columns) | set(label_names) | {"label", "label_ids"}
    unused = [c for c in dataset.column_names if c not in keep]
    return dataset.remove_columns(unused) if unused else dataset


@dataclass
class Built:
    """What ``build_engine`` returns; the Trainer keeps each under the same name."""

    engine: Any
    topology: Any
    train_dataset: Any
    train_dataloader: Any
    steps_per_epoch: int
    max_steps: int
    num_epochs: int
    num_parameters: int


def build_engine(
    *,
    model: nn.Module,
    args: Any,
    train_dataset: Any,
    data_collator: Callable,
    optimizer: Any,
    lr_scheduler: Any,
    label_names: list[str],
) -> Built:
    """Process group, mesh, training loader, schedule and engine (the Trainer calls this
    once)."""
    import meshtrain
    from meshtrain.data.loader import ResumableDataLoader
    from meshtrain.data.sampler import DistributedSampler
    from meshtrain.distributed.env import read_env
    from meshtrain.engine.start import join_mesh

    # the one set-up path (engine/start.py): the process group from the config's
    # distributed section, the mesh from its mesh section (deepspeed= and mesh= merged)
    topology = join_mesh(args.to_engine_config(world_size=read_env().world_size))
    dp, gas = topology.dp_size, args.gradient_accumulation_steps
    loader = None
    if train_dataset is not None:
        train_dataset = prepare_dataset(train_dataset, args, signature_columns(model), label_names)
        # transformers' training order: accelerate's SeedableRandomSampler (randperm from
        # data_seed or seed, + epoch) cut into per-device batches, whole batches dealt to
        # the ranks and the last global batch padded with the epoch's first rows
        # (BatchSamplerShard, even_batches): which rows share a batch is what a padding
        # or masking collator sees (data.sampler, "Dealing whole batches")
        sampler = DistributedSampler(
            train_dataset,
            num_replicas=dp,
            rank=topology.dp_rank,
            shuffle=True,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            drop_last=args.dataloader_drop_last,
            deal_batch=args.per_device_train_batch_size,
        )
        loader = ResumableDataLoader(
            train_dataset,
            args.per_device_train_batch_size,
            sampler=sampler,
            collate_fn=data_collator,
            drop_last=args.dataloader_drop_last,
            num_workers=args.dataloader_num_workers,
            lookahead=True,  # a masking collator's draws around dropout's, as the peer's
        )
        steps_per_epoch = max(1, math.ceil(len(loader) / gas))
    else:
        steps_per_epoch = 1
    if args.max_steps > 0:
        max_steps = args.max_steps
    else:
        max_steps = max(1, math.ceil(args.num_train_epochs * steps_per_epoch))
    num_epochs = math.ceil(max_steps / steps_per_epoch)
    config = args.to_engine_config(total_steps=max_steps, world_size=topology.world_size)
    scheduler = lr_scheduler
    if scheduler is None and "scheduler" not in config:
        from meshtrain.optim.lr_scheduler_types import scheduler_factory

        warmup = args.warmup_for(max_steps)
        scheduler = scheduler_factory(args.lr_scheduler_type, warmup, max_steps)
    num_parameters = sum(
        p.numel() for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad
    )
    if optimizer is None and config.get("optimizer", {}).get("type") in ("AdamW8bit", "Lion8bit"):
        from meshtrain.optim.optimizers import keep_embeddings_32bit

        keep_embeddings_32bit(model)  # as transformers' Trainer does for its 8-bit names
    engine, _, _, _ = meshtrain.initialize(
        model=model,
        training_data=loader,  # its position goes into checkpoints
        model_parameters=param_groups(model),
        config=config,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        topology=topology,
    )
    return Built(
        engine=engine,
        topology=topology,
        train_dataset=train_dataset,
        train_dataloader=loader,
        steps_per_epoch=steps_per_epoch,
        max_steps=max_steps,
        num_epochs=num_epochs,
        num_parameters=num_parameters,
    )


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


__all__ = [
    "Built",
    "apply_use_cache",
    "build_engine",
    "choose_collator",
    "default_collator",
    "param_groups",
    "prepare_dataset",
    "signature_columns",
]

"""How the Engine builds its optimizer and LR scheduler over the fp32 master chunks.

The optimizer never sees the model's parameters: each param group's ``params`` become
the master chunks of its ``FlatGroup``s (``meshtrain.parallel.zero.flat_group``). A client optimizer
or scheduler stays the object the user holds: its param groups are re-pointed.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.errors import ConfigError


def param_groups(model: nn.Module, model_parameters) -> list[dict]:
    """Normalise ``model_parameters`` (params, or torch-style group dicts) to group dicts."""
    if model_parameters is None:
        model_parameters = model.parameters()
    items = list(model_parameters)
    if not items:
        raise ConfigError("model_parameters is empty; pass model.parameters() or param groups")
    if isinstance(items[0], dict):
        groups = [dict(g, params=list(g["params"])) for g in items]
    else:
        groups = [{"params": items}]
    seen: set[int] = set()
    for g in groups:  # a tied weight appears once; frozen ones are dropped
        kept = []
        for p in g["params"]:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                kept.append(p)
        g["params"] = kept
    return [g for g in groups if g["params"]]


def make_optimizer(config, client, groups: list[dict], zero, device) -> torch.optim.Optimizer:
    """The optimizer steps master chunks; a client optimizer is re-pointed at them so
    that it (and a scheduler built on it) stays the object the user holds."""
    masters = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [m for fg in fgs for m in fg.master_params],
        }
        for g, fgs in zip(groups, zero.per_group, strict=True)
    ]
    if client is not None:
        client.state.clear()
        for pg, m in zip(client.param_groups, masters, strict=False):
            pg["params"] = m["params"]
        return client
    from meshtrain.optim.optimizers import build_optimizer

    cfg = config.optimizer
    if cfg is None:
        raise ConfigError(
            'optimizer: no optimizer given; add an "optimizer" section '
            '(e.g. {"type": "AdamW", "params": {"lr": 1e-4}}) or pass optimizer='
        )
    params = (
        cfg.params if isinstance(cfg.params, dict) else cfg.params.model_dump(exclude_none=True)
    )
    return build_optimizer(cfg.type, params, masters, device_type=device.type)


def make_scheduler(config, client, optimizer):
    if client is not None:
        return client(optimizer) if callable(client) and not hasattr(client, "step") else client
    cfg = config.scheduler
    if cfg is None:
        return None
    from meshtrain.optim.lr_schedules import build_scheduler

    params = (
        cfg.params if isinstance(cfg.params, dict) else cfg.params.model_dump(exclude_none=True)
    )
    return build_scheduler(cfg.type, params, optimizer)

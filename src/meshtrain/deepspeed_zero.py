"""DeepSpeed's ``deepspeed.zero`` user API (``Init``, ``GatheredParameters``), imported by
users as ``meshtrain.zero``: build models too big for one rank, and reach their
partitioned weights.

Named ``deepspeed_zero`` so it cannot be mistaken for ZeRO itself: the implementation
(flat groups, the gradient reducer, the stages) is ``meshtrain.parallel.zero``; this
module is the two context managers DeepSpeed users type, with its names and arguments::

    with meshtrain.zero.Init(config_dict_or_path="ds_config.json"):   # ZeRO stage 3
        model = MyModel()           # each rank keeps 1/N of every parameter
    engine, *_ = meshtrain.initialize(model=model, config="ds_config.json")

    with meshtrain.zero.GatheredParameters(model.embed.weight, modifier_rank=0):
        if rank == 0:
            model.embed.weight[0].zero_()   # lands in every rank's shard (and the masters)

**Init.** While the context is open, every ``nn.Module`` constructor is followed by a step
that partitions the parameters it created (``meshtrain.parallel.zero.partition`` has the
layout and the DeepSpeed attributes ``ds_tensor``/``ds_shape``/``ds_numel``). A module's
own constructor runs unchanged on every rank -- same shapes, same random stream -- so the
values are exactly those the same code gives outside the context; rank 0's are then
broadcast (as the Engine's start-up broadcast does) and each rank keeps its slice. Only
the module being constructed is ever whole, so a rank's peak is its shards plus the
largest single module's own parameters, never the model.

Why patch constructors: a parameter is registered *before* its module initialises it
(``nn.Linear`` calls ``reset_parameters`` after creating ``weight``), so partitioning has
to wait until the constructor returns. There is no constructor post-hook in torch, so
``Init`` wraps the ``__init__`` of every ``nn.Module`` subclass while it is open (and of
classes defined inside it) and restores them on exit; a per-object depth count makes the
outermost constructor the one that partitions.

A module whose constructor initialises *children's* parameters after building them
(``meshtrain.models.Decoder.reset_parameters``) must do it inside
``GatheredParameters(p, modifier_rank=0)``, as with DeepSpeed; the reference Decoder
does. transformers models do it in ``post_init`` and know nothing of meshtrain, so a
``PreTrainedModel`` is partitioned when its outermost constructor returns, and a model
``from_pretrained`` builds inside the context when the loaded model is returned: their
values then equal those outside the context exactly (random init or checkpoint), and the
rank's peak during construction is the whole model, as without the context. (DeepSpeed
keeps it lower there because transformers itself gathers module by module when it
detects DeepSpeed.)

**GatheredParameters.** Makes the listed parameters whole inside the block on every rank
(every rank must enter it). On exit, with ``modifier_rank=r`` rank ``r``'s values are
broadcast and written into every rank's shard -- and, once an Engine owns the
parameters, into its flat buffers and fp32 master weights under any ZeRO stage -- so a
change survives the next optimizer step. Without ``modifier_rank`` changes are dropped.
Parameters neither partitioned nor owned by an Engine are left alone (no collective).
"""

from __future__ import annotations

import functools
import itertools
import logging
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.config.sections import DistributedConfig
from meshtrain.distributed.comm import CommStats, Group
from meshtrain.errors import ConfigError
from meshtrain.parallel.zero import partition as part

log = logging.getLogger("meshtrain")


def _subclasses(root: type) -> list[type]:
    seen: dict[type, None] = {}
    stack = [root]
    while stack:
        cls = stack.pop()
        if cls not in seen:
            seen[cls] = None
            stack.extend(cls.__subclasses__())
    return list(seen)


def _group(pg: dist.ProcessGroup | None) -> Group:
    """A comm ``Group`` over ``pg`` (default: the world) with its own byte counters."""
    pg = pg or dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(pg))
    return Group("zero.Init", pg, ranks, ranks.index(dist.get_rank()), CommStats())


class Init:
    """Partition parameters at construction under ZeRO stage 3 (see the module docstring).

    Args:
        module: an already-built module to partition now (instead of using the context).
        data_parallel_group: a ``torch.distributed`` process group to partition over
            (default: the world; it must be the Engine's data-parallel group).
        remote_device: ``"cpu"`` keeps the shards in host memory; None keeps them where the
            parameter was created. ``"nvme"`` is refused.
        config_dict_or_path / config: a meshtrain/DeepSpeed config (dict, path or
            ``Config``). When given, a ZeRO stage other than 3 makes the context a no-op
            (the Engine keeps parameters whole below stage 3) and its precision is the
            shards' dtype.
        enabled: False makes the context a no-op.
        dtype: the shards' dtype (default: the config's precision, else unchanged).
        pin_memory, mem_efficient_linear: accepted for DeepSpeed compatibility; no effect.
        mpu: refused (model-parallel units are not supported).
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: dist.ProcessGroup | None = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
    ) -> None:
        if mpu is not None:
            raise ConfigError(
                "zero.Init: mpu= (model-parallel unit) is not supported; meshtrain "
                "partitions over the data-parallel group (data_parallel_group=)"
            )
        if remote_device not in (None, "cpu", "cuda", "none"):
            raise ConfigError(
                f"zero.Init: remote_device={remote_device!r} is not supported; use None "
                "(shards stay where the parameter was built) or 'cpu'"
            )
        if config is not None and config_dict_or_path is not None:
            raise ConfigError("zero.Init: pass one of config= and config_dict_or_path=")
        cfg_source = config if config is not None else config_dict_or_path
        self.enabled = bool(enabled)
        self.dtype = dtype
        self._distributed = DistributedConfig()
        if cfg_source is not None:
            from meshtrain.config import load_config
            from meshtrain.dtypes import PRECISIONS

            cfg = load_config(cfg_source)
            self._distributed = cfg.distributed
            stage = int(cfg.zero_optimization.stage)
            if stage != 3:
                log.info("zero.Init: zero_optimization.stage is %d, not 3: no effect", stage)
                self.enabled = False
            self.dtype = dtype or PRECISIONS[cfg.precision]
        self.shard_device = torch.device("cpu") if remote_device == "cpu" else None
        self._pg = data_parallel_group
        self._group: Group | None = None
        self._ids = itertools.count()
        self._depth: dict[int, int] = {}
        self._patched: list[tuple[type, Any]] = []
        self._subclass_hook: tuple[bool, Any] | None = None
        self._active = False
        self._hold = 0  # > 0: inside a transformers constructor or from_pretrained
        if module is not None and self.enabled:
            self._partition(module)

    # partitioning ----------------------------------------------------------------------------
    def _ensure_group(self) -> Group:
        if self._group is None:
            if not dist.is_initialized():
                from meshtrain.distributed.env import join_group

                join_group(self._distributed)  # the config's section, else its defaults
            self._group = _group(self._pg)
        return self._group

    def _partition(self, module: nn.Module) -> None:
        group = self._ensure_group()
        for p in module.parameters():
            if part.is_partitioned(p) or part.owner(p) is not None:
                continue
            part.partition(
                p, group, next(self._ids), dtype=self.dtype, device=self.shard_device, src=0
            )

    # constructor wrapping ----------------------------------------------------------------------
    def _wrap(self, original):
        @functools.wraps(original)
        def init_then_partition(module, *args, **kwargs):
            key = id(module)
            self._depth[key] = self._depth.get(key, 0) + 1
            # a transformers model initialises its children after building them
            # (post_init): hold partitioning until its outermost constructor returns
            hold = self._depth[key] == 1 and _is_transformers_model(module)
            self._hold += hold
            try:
                original(module, *args, **kwargs)
            finally:
                self._hold -= hold
                depth = self._depth.pop(key) - 1
                if depth:
                    self._depth[key] = depth
            if depth == 0 and self._active and not self._hold:
                self._partition(module)

        init_then_partition.__meshtrain_original__ = original
        return init_then_partition

    def _patch(self, cls: type) -> None:
        original = cls.__dict__.get("__init__")
        if original is not None:
            cls.__init__ = self._wrap(original)
            self._patched.append((cls, original, "__init__"))

    def _wrap_from_pretrained(self, pretrained: type) -> None:
        """transformers' ``from_pretrained`` builds the model (on the meta device) and
        then loads weights into it: partition once it returns the loaded model."""
        original = pretrained.__dict__["from_pretrained"]
        init = self

        @functools.wraps(original.__func__)
        def from_pretrained(cls, *args, **kwargs):
            init._hold += 1
            try:
                out = original.__func__(cls, *args, **kwargs)
            finally:
                init._hold -= 1
            if init._active and not init._hold:
                init._partition(out[0] if isinstance(out, tuple) else out)
            return out

        pretrained.from_pretrained = classmethod(from_pretrained)
        self._patched.append((pretrained, original, "from_pretrained"))

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        self._ensure_group()
        pretrained = _transformers_base(load=True)
        for cls in _subclasses(nn.Module):
            self._patch(cls)
        if pretrained is not None:
            self._wrap_from_pretrained(pretrained)
        # classes defined inside the context are wrapped as they are created
        had = "__init_subclass__" in nn.Module.__dict__
        hook = nn.Module.__dict__.get("__init_subclass__")
        self._subclass_hook = (had, hook)
        init = self

        def __init_subclass__(cls, **kwargs):
            if had:
                hook.__get__(None, cls)(**kwargs)
            else:
                super(nn.Module, cls).__init_subclass__(**kwargs)
            init._patch(cls)

        nn.Module.__init_subclass__ = classmethod(__init_subclass__)
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled or not self._active:
            return
        self._active = False
        for cls, original, name in reversed(self._patched):
            setattr(cls, name, original)
        self._patched.clear()
        had, hook = self._subclass_hook
        if had:
            nn.Module.__init_subclass__ = hook
        else:
            del nn.Module.__init_subclass__


def _transformers_base(load: bool = False) -> type | None:
    """``transformers.PreTrainedModel`` if the program imported transformers, else None
    (meshtrain never imports transformers for a program that does not use it). ``load``
    imports its lazily loaded ``modeling_utils`` (on entering the context, before any
    constructor is wrapped); otherwise only an already imported one is read, since a
    lazy import from inside a wrapped constructor fails."""
    import importlib
    import sys

    if load and "transformers" in sys.modules:
        importlib.import_module("transformers.modeling_utils")
    module = sys.modules.get("transformers.modeling_utils")
    return None if module is None else getattr(module, "PreTrainedModel", None)


def _is_transformers_model(module: nn.Module) -> bool:
    base = _transformers_base()
    return base is not None and isinstance(module, base)


class _Params:
    """What ``ZeroStage.gathered`` reads of a module: ``parameters()``."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self._params = params

    def parameters(self):
        return iter(self._params)


def _as_list(params) -> list[nn.Parameter]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    out, seen = [], set()
    for p in params:
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class GatheredParameters:
    """Whole parameters inside the block; ``modifier_rank``'s changes kept on exit.

    Args:
        params: a parameter or an iterable of them (None entries are skipped).
        modifier_rank: the (data-parallel group) rank whose values are kept; None drops
            changes made inside.
        fwd_module: accepted for DeepSpeed compatibility; not needed.
        enabled: False makes the context a no-op.

    Every rank must enter it with the same parameters. Change values in place
    (``p.data.copy_``, ``p[...] = ...`` under ``torch.no_grad``), not by rebinding ``p.data``.
    """

    def __init__(
        self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True
    ) -> None:
        self.params = _as_list(params) if enabled else []
        self.modifier_rank = modifier_rank
        self._stack = ExitStack()
        self._loose: list[nn.Parameter] = []  # partitioned by Init, no Engine yet
        self._owned: dict[int, tuple[Any, list[nn.Parameter]]] = {}  # by ZeroStage

    def __enter__(self) -> GatheredParameters:
        for p in self.params:
            owner = part.owner(p)
            if owner is not None:
                self._owned.setdefault(id(owner), (owner, []))[1].append(p)
            elif part.is_partitioned(p):
                self._loose.append(p)
        with torch.no_grad():
            for p in self._loose:
                p.data = part.full_value(p, p.device).to(dtype=p.dtype, copy=True)
        for zero, params in self._owned.values():
            self._stack.enter_context(zero.gathered(_Params(params)))
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.modifier_rank is not None and exc[0] is None:
                for zero, params in self._owned.values():
                    _write_back(zero, params, self.modifier_rank)
            with torch.no_grad():
                for p in self._loose:
                    if self.modifier_rank is not None and exc[0] is None:
                        part.store(p, p.data, self.modifier_rank)
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        finally:
            self._stack.close()


def _write_back(zero, params: list[nn.Parameter], src: int) -> None:
    """Broadcast ``params`` from dp rank ``src`` and write them into ``zero``'s storage:
    the parameter shard (stage 3) and the fp32 masters where they are a separate copy."""
    from meshtrain.distributed import comm

    dp = zero.topology.dp_group
    with torch.no_grad():
        for g in [*zero.flat_groups, *zero.frozen_groups]:
            mine = [p for p in params if p in g.bucket_of]
            buckets = {id(g.bucket_of[p]): g.bucket_of[p] for p in mine}
            for p in mine:  # p.data is a view of the gathered bucket or of param_flat
                comm.broadcast(p.data, src, dp, label="zero.GatheredParameters")
            for b in buckets.values():
                if g.shard_params:
                    full = torch.zeros(b.numel, dtype=g.dtype, device=g.device)
                    for q, view in g.views(b, full, base=b.start):
                        view.copy_(q.data)
                    b.in_shard(g.param_shard).copy_(full.narrow(0, g.rank * b.chunk, b.chunk))
                if not g.master_aliases_params:
                    g.master_chunks[b.index].copy_(g.owned_params(b))


__all__ = ["GatheredParameters", "Init"]

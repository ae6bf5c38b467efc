"""``remove_tensor_parallel``: undo ``apply_tensor_parallel``, leaving every rank with the
original modules holding the whole, unpadded trained weights.

``apply_tensor_parallel`` writes what it changes into a ``Changes`` record kept on the
model (``model.meshtrain_tp_changes``): the modules it replaced (with the parent and the
attribute they hang on), the aliases it repointed, every hook handle it registered, and
every attribute it set (a plan's head counts, the loss function, the ``generate``
wrapper). The replaced modules keep their original ``Parameter`` objects, emptied to zero
elements so no full copy stays in memory while the model trains sharded.

Undoing it, per sharded parameter of ``s`` local elements (``T`` ranks): one all-gather
over the tp group of ``T x s`` elements (recorded under ``"state_dict"``, so training
traffic figures stay exact), padding units dropped, written into the original
``Parameter`` object; tied parameters (an embedding and its LM head) are gathered once.
The original modules go back where they were, hooks are removed and attributes restored,
so the model is again the one the user built, with the trained weights: a transformers
``pipeline(...)`` or ``generate`` runs on it on any rank, without collectives. Replicated
parameters (norms, row-layer biases) were never replaced and simply stay.

Every rank of the tp group must call it (it all-gathers). An engine built on the model
cannot step it afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from meshtrain.distributed.comm import Group
from meshtrain.parallel.tensor.sharding import unshard_tensor

_MISSING = object()


@dataclass
class Changes:
    """What ``apply_tensor_parallel`` changed on one model (see the module docstring)."""

    modules: list[tuple[nn.Module, str, nn.Module, nn.Module]] = field(default_factory=list)
    aliases: list[tuple[nn.Module, str, nn.Parameter]] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)
    attrs: list[tuple[Any, str, Any]] = field(default_factory=list)

    def replace(self, parent: nn.Module, child: str, new: nn.Module) -> None:
        """Hang ``new`` in place of ``parent.<child>``; empty the original's parameters
        that ``new`` holds shards of (its replicated ones, e.g. a row bias, stay)."""
        original = getattr(parent, child)
        self.modules.append((parent, child, original, new))
        self.handles.extend(getattr(new, "param_hooks", ()))  # on replicated parameters
        setattr(parent, child, new)
        with torch.no_grad():
            for name in getattr(new, "tp_specs", {}):
                p = getattr(original, name)
                if p.numel():  # a tied parameter may be emptied already
                    p.data = p.data.new_empty(0)

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """``setattr(obj, name, value)``, remembering the instance ``__dict__`` entries it
        changes (a property setter may write another key, as transformers'
        ``loss_function`` writes ``_loss_function``)."""
        before = dict(vars(obj))
        setattr(obj, name, value)
        for key, new in vars(obj).items():
            old = before.get(key, _MISSING)
            if old is not new:
                self.attrs.append((obj, key, old))


def remove_tensor_parallel(model: nn.Module, group: Group) -> nn.Module:
    """Put back the modules ``apply_tensor_parallel`` replaced, with the whole trained
    weights gathered from ``group`` (see the module docstring); returns ``model``."""
    changes: Changes | None = getattr(model, "meshtrain_tp_changes", None)
    if changes is None:
        return model
    done: set[int] = set()  # tied parameters are gathered once
    with torch.no_grad():
        for _, _, original, new in changes.modules:
            for name, spec in new.tp_specs.items():
                p = getattr(original, name)
                if id(p) not in done:
                    done.add(id(p))
                    p.data = unshard_tensor(getattr(new, name), spec, group)
                    p.grad = None
    for handle in changes.handles:
        handle.remove()
    for parent, child, original, _ in reversed(changes.modules):
        setattr(parent, child, original)
    for mod, name, p in changes.aliases:
        mod._parameters[name] = p
    for obj, key, old in reversed(changes.attrs):
        if old is _MISSING:
            vars(obj).pop(key, None)
        else:
            vars(obj)[key] = old
    return model


__all__ = ["Changes", "remove_tensor_parallel"]

"""Where and in which dtype the engine puts a model before parallelizing it.

Every parameter and floating buffer moves to the topology's device. The dtype follows the
configured precision, with one exception: in an **fp32** run a *frozen* floating parameter
(``requires_grad=False``: a LoRA base the user loaded in bf16, a frozen embedding) keeps
the dtype it was loaded in, as transformers' Trainer and accelerate leave it (neither casts
the model in fp32; DeepSpeed's engine casts only when fp16/bf16 is enabled). Upcasting it
would double a bf16 base's bytes for nothing: it gets no gradient and no optimizer state,
so nothing is gained by computing its matmuls in fp32 that the user did not ask for.
Trainable parameters follow the precision as before (fp32 here), so the optimizer steps
fp32 values; peft's LoRA layers already keep fp32 adapters on a bf16 base and cast their
input (``autocast_adapter_dtype``).

With ``bf16``/``fp16`` enabled the whole model is cast, frozen parameters included, as
DeepSpeed's engine does (``module.bfloat16()``): a narrower frozen copy only saves memory,
and the model must compute in one dtype there (the engine casts inputs to it).

A model whose parameters then have mixed dtypes needs its activations to follow: a head
trained whole (peft's ``modules_to_save``), now fp32, reads the bf16 output of the frozen
encoder, and ``F.linear`` refuses mixed dtypes. transformers never meets this (it casts
nothing, so the head trains in bf16). So when the cast spared a frozen parameter whose
dtype differs from ``dtype``, every module that directly owns floating parameters gets a
forward pre-hook casting its floating tensor arguments to its own parameters' dtype
(``weight``'s, else the first one's): a no-op where they already agree (every frozen bf16
linear of a bf16 base fed by bf16 activations; peft's LoRA layers own no parameter
directly and cast for themselves). The hooks exist only on such mixed models. A module
that owns both frozen and trainable parameters (a frozen weight with a trainable bias,
peft's ``bias="all"``) is cast whole, as before, so that no module mixes dtypes itself.

The cast is per tensor (``param.data = param.data.to(dtype)``, what ``nn.Module.to``
does), so a spared bf16 base is never materialised in fp32, even transiently. Integer
tensors (bitsandbytes' packed 4-bit / int8 weights, index buffers) are never cast.
"""

from __future__ import annotations

import torch
from torch import nn


def place_model(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Move ``model`` to ``device`` and cast it to ``dtype`` as the module docstring says;
    returns the model (the same object, as ``nn.Module.to``)."""
    model = model.to(device=device)
    spare_frozen = dtype == torch.float32
    spared = False
    with torch.no_grad():
        for module in model.modules():
            own = [p for p in module._parameters.values() if p is not None]
            # a module that also owns trainable parameters (a frozen weight with a
            # trainable bias) computes in one dtype: its frozen ones follow the precision
            mixed = any(p.requires_grad and p.is_floating_point() for p in own)
            for p in own:
                if not p.is_floating_point() or p.dtype == dtype:
                    continue
                if spare_frozen and not p.requires_grad and not mixed:
                    spared = True
                    continue
                p.data = p.data.to(dtype)
            for name, b in module._buffers.items():
                if b is not None and b.is_floating_point() and b.dtype != dtype:
                    module._buffers[name] = b.to(dtype)
    if spared:
        _cast_inputs_to_own_dtype(model)
    return model


def _own_dtype(module: nn.Module) -> torch.dtype | None:
    own = {n: p for n, p in module._parameters.items() if p is not None and p.is_floating_point()}
    if not own:
        return None
    weight = own.get("weight")
    return (weight if weight is not None else next(iter(own.values()))).dtype


def _cast_inputs_to_own_dtype(model: nn.Module) -> None:
    """Pre-hooks casting floating tensor arguments to each parameter-owning module's dtype
    (module docstring)."""

    def cast(x, dtype):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    def hook(module, args, kwargs):
        dtype = _own_dtype(module)
        if dtype is None:
            return None
        args = tuple(cast(a, dtype) for a in args)
        kwargs = {k: cast(v, dtype) for k, v in kwargs.items()}
        return args, kwargs

    for module in model.modules():
        if _own_dtype(module) is not None:
            module.register_forward_pre_hook(hook, with_kwargs=True)


__all__ = ["place_model"]

"""The gradients an Accelerator user sees, on meshtrain's flat buffers.

accelerate's contract for ``p.grad`` (DDP underneath), which this module keeps:

* ``accelerator.backward(loss)`` backpropagates ``loss / gradient_accumulation_steps``;
* inside ``accumulate(model)`` before the window's last micro-step (``sync_gradients``
  False) nothing is communicated: ``p.grad`` is this rank's local sum;
* after a synchronising backward ``p.grad`` is the gradient *averaged* over the
  data-parallel ranks;
* ``clip_grad_norm_(params, max_norm)`` clips those gradients in place and returns the
  global norm before clipping; ``optimizer.step()`` / ``zero_grad()`` act only when
  ``sync_gradients`` is True.

How the Engine's machinery is driven (one ``EngineDriver`` per trained model): the
Engine is built with ``gradient_accumulation_steps = 1`` and the Accelerator decides which
backward synchronises (accelerate's ``_do_sync`` counting), through the Engine's window
driver (``engine.window``, the one place the ZeRO lifecycle is called): ``open`` after
each step or ``zero_grad``, ``before_backward(sync)`` (which returns the loss multiplier,
the loss scale over ``f``), the backward, ``after_backward(sync)``. The bucketed,
overlapped reduction into the flat buffer is the engine's, unchanged.

Where the averaging pass goes: the reduction leaves the *sum* over ranks in the flat
buffer; at a synchronising backward at ZeRO stages 0-1 the Engine finishes the reduction
and multiplies the gradient chunks by ``f / dp`` in place (``ZeroStage.average_``, the
same call ``engine.backward`` makes at its boundary, DeepSpeed's semantics), and the
stage's ``grad_scale`` says what is left for the step's copy into the fp32 masters (no
``1 / dp`` any more). Stages 2-3 keep the sum: their gradients live in sharded
buffers and ``p.grad`` is None after backward, as under accelerate's DeepSpeed plugin.

ZeRO stage 1 follows DeepSpeed (the peer that defines ZeRO; accelerate hands ZeRO to it):
after the synchronising backward ``p.grad`` is None, because each rank holds only its
slice of the averaged gradient; ``meshtrain.utils.safe_get_full_grad(p)`` (DeepSpeed's
``deepspeed.utils.safe_get_full_grad``) assembles it, a collective every rank calls.

After ``optimizer.step()`` at stage 0 ``p.grad`` keeps the gradient the step used (the
averaged one, clipped if ``clip_grad_norm_`` ran) until ``zero_grad()``, as under
accelerate's DDP: nothing is copied, ``.grad`` is pointed at its view of the flat buffer
again, and a backward without ``zero_grad()`` accumulates into it (DDP's result: the old
average plus the new one); in fp16 it is unscaled then, as accelerate's ``GradScaler.step``
leaves it (one pass over the fp16 gradients, fp16 only). At stages 1-3 it is None after
the step (DeepSpeed).
``clip_grad_norm_`` at a synchronising step unscales (fp16) and clips in place: stage 0
through ``torch.nn.utils.clip_grad_norm_`` on the ``p.grad`` views (any subset, any
norm type, exactly accelerate's call), stages 1-3 through the engine's global L2 norm over
every shard; the step then applies neither scale nor clip again.

A sum of averaged gradients stays right: a second synchronising backward in a window
(a GAN's discriminator reached again by the generator's loss) adds local gradients to
the averaged ones, the reduction sums ``dp x averaged + sum(local)``, and the division
gives ``averaged + mean(local)``, DDP's result.
"""

from __future__ import annotations

import torch

from meshtrain.accelerate.collectives import all_reduce_staged
from meshtrain.errors import ConfigError


class EngineDriver:
    """Drives one Engine's backward for the Accelerator (module docstring)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.window_open = False  # has this window's first backward run?
        self.touched = False  # did the running backward reach this engine's parameters?
        self.reduced_before = False  # was the window reduced before this backward?
        self.synced = False  # did a backward of this window synchronise (not no_sync)?
        self.params = [p for g in engine.zero.flat_groups for p in g.params]
        self.param_ids = {id(p) for p in self.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._touch) for p in self.params]

    def _touch(self, _param) -> None:
        self.touched = True

    @property
    def stage(self) -> int:
        return self.engine.zero_stage

    def before_backward(self, sync: bool) -> float:
        """Open the window if this is its first backward; return the loss multiplier
        (the loss scale over ``f``, ``ZeroStage.loss_multiplier``)."""
        window = self.engine.window
        if not self.window_open:
            window.open()
            self.window_open = True
        self.touched = False
        self.reduced_before = self.engine.zero.window_reduced  # a second reduction?
        return window.before_backward(sync, 1)  # accelerate divided the loss by its steps

    def after_backward(self, sync: bool, loss: torch.Tensor) -> None:
        if not self.touched:
            return  # nothing landed and nothing was launched: leave the window as it is
        engine = self.engine
        if self.stage == 1 and self.reduced_before:
            raise ConfigError(
                "backward: at ZeRO stage 1 a window's gradient is reduced once, into each "
                "rank's slice; this backward reached the model again after its "
                "synchronising backward (e.g. a GAN's discriminator through the "
                "generator's loss). Call optimizer.step() and zero_grad() before it, detach "
                "the input it reached this model through, or use ZeRO stage 0"
            )
        engine.log.add_loss(loss.detach())
        self.synced = self.synced or sync
        # sync: stages 0-1 reduce now and average in place; at every stage the gradients
        # are final then
        engine.window.after_backward(sync)

    def keep_local(self) -> None:
        """Before ``optimizer.step()``: a window whose backwards all ran inside
        ``no_sync`` (local SGD: accelerate's ``LocalSGD``, DDP's ``no_sync`` then a step)
        steps on this rank's own gradients, as DDP does, instead of reducing them at the
        step. Stage 0 only: at stage 1 each rank steps only its slice of the masters and
        the others' slices come from their owners, and at stages 2-3 every backward has
        reduce-scattered already, so no rank could step on its own gradient; the step is
        refused there by name rather than run as plain data parallelism (accelerate
        refuses ``LocalSGD`` under DeepSpeed at every stage)."""
        if not self.window_open or self.synced:
            return
        zero = self.engine.zero
        if self.stage >= 1 and self.engine.topology.dp_size > 1:
            why = (
                "a rank steps only its slice of the optimizer state"
                if self.stage == 1
                else "every backward reduce-scatters the gradients (the step would use "
                "the average, not this rank's own)"
            )
            raise ConfigError(
                "optimizer.step() after backward passes all inside no_sync (local SGD): at "
                f"ZeRO stage {self.stage} {why}, so no rank can step on its own gradient; "
                "use ZeRO stage 0, or step after a synchronising backward"
            )
        if self.stage == 0:
            zero.keep_local_window()  # the step then divides by the loss scale / f only

    def after_step(self, scaled: float = 1.0) -> None:
        """Stage 0: ``p.grad`` keeps the step's gradient until ``zero_grad()`` (DDP), in
        fp16 unscaled (``scaled``: the loss scale it still carried), as accelerate's
        ``GradScaler.step`` leaves it. The step read fp16 gradients through a copy, so
        only those are divided here (fp32 ones carry no scale)."""
        self.window_open = False
        self.synced = False
        if self.stage != 0:
            return
        self.engine.zero.relink_grads(scaled)

    def zero_grad(self) -> None:
        """``optimizer.zero_grad()`` at a boundary: the next backward starts a fresh window."""
        self.engine.zero.after_step()  # clears every gradient, reopens the reduction
        self.window_open = False
        self.synced = False

    def clip_(self, parameters: list[torch.Tensor], max_norm: float, norm_type: float):
        """Clip this engine's global gradient in place at a synchronising step; return
        the norm before clipping (a 0-d tensor)."""
        engine, zero = self.engine, self.engine.zero
        if engine.clipped_this_step:
            raise ConfigError(
                "clip_grad_norm_: called twice for one optimizer step; clip once, after the "
                "window's last backward"
            )
        zero.before_step()  # stages 2-3: nothing left to wait for; 0-1: reduced already
        # stage 0 without experts: torch's own clip on the p.grad views; otherwise (sharded,
        # or a rank holding only its experts) the engine's global L2 norm
        if zero.plain_grads:
            zero.unscale_()
            norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
            value = float(norm)
        else:
            if float(norm_type) != 2.0:
                raise ConfigError(
                    f"clip_grad_norm_(norm_type={norm_type}): at ZeRO stage {self.stage} "
                    "the gradient is sharded and the engine computes the global L2 norm; "
                    "use norm_type=2 (or ZeRO stage 0)"
                )
            if {id(p) for p in parameters} != self.param_ids:
                raise ConfigError(
                    f"clip_grad_norm_: at ZeRO stage {self.stage} clip every trainable "
                    "parameter of the model at once (model.parameters()); the sharded "
                    "gradient has no per-parameter norm"
                )
            value = zero.clip_(max_norm, engine.scaled_grad_norm())
            norm = torch.tensor(value)
        engine.clipped(value)
        return norm

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def average_plain_grads(models, group, world: int) -> None:
    """Average over dp the gradients of the prepared models without an engine that the
    last backward reached (one all-reduce of their concatenation), as DDP would."""
    if world == 1:
        return
    grads = [
        p.grad
        for m in models
        if m.engine is None and m.__dict__.get("touched")
        for p in m.module.parameters()
        if p.grad is not None
    ]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce_staged(flat, group)
        flat /= world
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _params(parameters) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def clip_grad_norm(models, parameters, max_norm: float, norm_type: float, sync: bool):
    """``Accelerator.clip_grad_norm_``: the engine's in-place clip at a synchronising
    step, torch's on the local gradients otherwise (or for models without an engine)."""
    params = _params(parameters)
    ids = {id(p) for p in params}
    drivers = [m.driver for m in models if m.driver is not None and ids & m.driver.param_ids]
    if not drivers or not sync:
        grads = [p for p in params if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type=norm_type)
    if len(drivers) > 1:
        raise ConfigError(
            "clip_grad_norm_: the parameters belong to several prepared models; clip "
            "each model's parameters in its own call"
        )
    return drivers[0].clip_(params, float(max_norm), float(norm_type))


def clip_grad_value(models, parameters, clip_value: float) -> None:
    """``Accelerator.clip_grad_value_``: ZeRO stage 0 (or no engine) only."""
    params = _params(parameters)
    ids = {id(p) for p in params}
    for m in models:
        d = m.driver
        if d is not None and d.stage > 0 and ids & d.param_ids:
            raise ConfigError(
                f"clip_grad_value_: at ZeRO stage {d.stage} the gradient is sharded "
                "and p.grad is not it; use clip_grad_norm_ (or ZeRO stage 0)"
            )
    torch.nn.utils.clip_grad_value_([p for p in params if p.grad is not None], clip_value)


__all__ = ["EngineDriver", "average_plain_grads", "clip_grad_norm", "clip_grad_value"]

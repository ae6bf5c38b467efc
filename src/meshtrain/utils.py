"""``meshtrain.utils``: DeepSpeed's ``deepspeed.utils`` helpers that training scripts call.

``safe_get_full_grad(param)``: the gradient averaged over the data-parallel ranks, at any
ZeRO stage, between a synchronising backward and the optimizer step (a collective at
stages 1-3: every rank calls it). See ``meshtrain.engine.visible_grads``.
"""

from meshtrain.engine.visible_grads import safe_get_full_grad

__all__ = ["safe_get_full_grad"]

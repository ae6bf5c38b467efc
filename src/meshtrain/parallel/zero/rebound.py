"""Parameters whose ``.data`` a script reassigned, taken back into the flat storage.

accelerate's ``LocalSGD`` averages a model with ``param.data = reduce(param.data)``. Under
ZeRO stages 0-2 every trainable parameter is a view of its ``FlatGroup``'s ``param_flat``
and the optimizer steps masters that are (or are copied from) that storage, so a
reassigned parameter silently left the engine: the forward used the new value, the step
updated the old one and never wrote it back, and the model froze at the first average.
A ``.data`` setter cannot be hooked, so the Engine calls :func:`adopt_rebound` before
each forward, step, checkpoint and weights file (``save_weights``, accelerate's
``save_model``: LocalSGD averages once more on exit, just before a script saves): one pointer comparison per parameter, and for a
moved one a copy of its value into its view (nothing is communicated). Sharded
parameters (ZeRO-3) are placeholders between uses and are not checked.
"""

from __future__ import annotations

import torch

from meshtrain.errors import ConfigError
from meshtrain.parallel.zero.flat_group import FlatGroup


def adopt_rebound(groups: list[FlatGroup]) -> bool:
    """Point every reassigned parameter of ``groups`` at its view again, its new value
    copied there; separate fp32 masters of the touched buckets are refreshed from the
    parameters (the value set, in the model dtype). Returns whether any was taken back."""
    found = False
    with torch.no_grad():
        for g in groups:
            if g.param_flat is None:
                continue
            touched = []
            for b in g.buckets:
                moved = [
                    (p, view)
                    for p, view in g.views(b, g.param_flat)
                    if p.data_ptr() != view.data_ptr()
                ]
                for p, view in moved:
                    if p.shape != view.shape:
                        raise ConfigError(
                            f"param.data: a parameter of shape {tuple(view.shape)} was given "
                            f"a tensor of shape {tuple(p.shape)}; assign a value of its shape"
                        )
                    view.copy_(p.data)
                    p.data = view
                if moved:
                    touched.append(b)
            if not g.master_aliases_params:
                for b in touched:
                    g.master_chunks[b.index].copy_(g.owned_params(b))
            found = found or bool(touched)
    return found

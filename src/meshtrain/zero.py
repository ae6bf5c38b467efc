"""``meshtrain.zero``: DeepSpeed's import path (``deepspeed.zero.Init``) kept for users.

The API lives in ``meshtrain.deepspeed_zero``; ZeRO's implementation in
``meshtrain.parallel.zero``. Nothing in meshtrain imports this module.
"""

from meshtrain.deepspeed_zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init"]

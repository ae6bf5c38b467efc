"""``meshtrain estimate``: the ZeRO paper's model-state formulas (``model``) and the
command line (``cli``)."""

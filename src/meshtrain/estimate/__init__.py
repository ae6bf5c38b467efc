"""``meshtrain estimate``: the ZeRO paper's model-state formulas (``model_states``), the
pipeline's memory and bubble (``pipeline``) and the command line (``cli``)."""

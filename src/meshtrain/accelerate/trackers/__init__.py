"""accelerate's experiment trackers (``Accelerator(log_with=...)``): TensorBoard as
accelerate writes it, meshtrain's JSONL, and the choice of which ones run
(``choice.py``)."""

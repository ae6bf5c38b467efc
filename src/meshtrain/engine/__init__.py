"""The Engine: the training step (``engine``), its entry point ``initialize``
(``initialize``), the per-step log (``step_log``) and ``memory_report`` (``memory``)."""

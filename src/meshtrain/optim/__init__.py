"""Optimizers by DeepSpeed name (``optimizers``), LR schedules (``lr_schedules``), and how
the Engine points them at its fp32 master chunks (``setup``)."""

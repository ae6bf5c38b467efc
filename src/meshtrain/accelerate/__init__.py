"""accelerate's ``Accelerator`` API on meshtrain's Engine (``meshtrain.Accelerator``)."""

from meshtrain.accelerate.accelerator import Accelerator

__all__ = ["Accelerator"]

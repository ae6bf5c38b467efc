"""Interop: other frameworks' files in, and files other frameworks read out.

The third floor of checkpointing (``docs/architecture.md``): ``checkpoint/`` is meshtrain's
own format alone, ``engine/checkpoint_*.py`` map an Engine onto it, and this package
brings in and out what transformers, peft and the other frameworks write:

* :mod:`~meshtrain.interop.from_pretrained` -- ``meshtrain.from_pretrained``, the front
  door: a transformers folder (or a meshtrain checkpoint of a transformers model) read
  slice by slice onto any layout.
* :mod:`~meshtrain.interop.safetensors_source` -- a ``save_pretrained`` folder as a
  source the engine's loader reads element ranges from.
* :mod:`~meshtrain.interop.merge_lora`, :mod:`~meshtrain.interop.dequantize` -- peft
  LoRA adapters merged into their (dequantized) base for a plain transformers export.
* :mod:`~meshtrain.interop.consolidate_command` -- ``meshtrain consolidate``.
"""

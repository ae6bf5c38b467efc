"""The one dtype table: every dtype meshtrain reads or writes, with its three spellings.

* precision name - what a config, the Trainer and the command lines say (``fp32``,
  ``bf16``, ``fp16``): the training dtype, ``serve --dtype``, ``consolidate --dtype``;
* manifest name - ``str(dtype)`` without ``torch.`` (``bfloat16``), as checkpoint
  manifests store it;
* safetensors code - the header's ``BF16``, for files written without the library.

The tables below are read-only views of ``_TABLE``, so a caller cannot change them.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

_TABLE = (
    # dtype,         manifest,   safetensors, precision
    (torch.float64, "float64", "F64", None),
    (torch.float32, "float32", "F32", "fp32"),
    (torch.float16, "float16", "F16", "fp16"),
    (torch.bfloat16, "bfloat16", "BF16", "bf16"),
    (torch.int64, "int64", "I64", None),
    (torch.int32, "int32", "I32", None),
    (torch.int16, "int16", "I16", None),
    (torch.int8, "int8", "I8", None),
    (torch.uint8, "uint8", "U8", None),
    (torch.bool, "bool", "BOOL", None),
)

PRECISIONS: Mapping[str, torch.dtype] = MappingProxyType(
    {p: d for d, _, _, p in _TABLE if p is not None}
)
"""``"fp32" | "bf16" | "fp16"`` -> the training / serving / consolidation dtype."""

BY_MANIFEST_NAME: Mapping[str, torch.dtype] = MappingProxyType({n: d for d, n, _, _ in _TABLE})
"""A checkpoint manifest's dtype string -> dtype (every dtype a checkpoint may hold)."""

SAFETENSORS_CODES: Mapping[torch.dtype, str] = MappingProxyType({d: c for d, _, c, _ in _TABLE})
"""dtype -> the safetensors header code."""

__all__ = ["BY_MANIFEST_NAME", "PRECISIONS", "SAFETENSORS_CODES"]

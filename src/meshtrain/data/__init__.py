"""Data at scale: a resumable distributed sampler, memory-mapped token stores, collators.

Names are loaded lazily (PEP 562): ``import meshtrain.data`` imports neither torch nor the
Hugging Face libraries; each name pulls in only its own module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "DistributedSampler": "meshtrain.data.sampler",
    "ResumableDataLoader": "meshtrain.data.loader",
    "prepare": "meshtrain.data.prepare_store",
    "PrepareResult": "meshtrain.data.prepare_store",
    "TokenStore": "meshtrain.data.store",
    "TokenDataset": "meshtrain.data.store",
    "ByteTokenizer": "meshtrain.data.tokenizer",
    "load_tokenizer": "meshtrain.data.tokenizer",
    "as_tokenizer": "meshtrain.data.tokenizer",
    "PaddingCollator": "meshtrain.data.collators",
    "CausalLMCollator": "meshtrain.data.collators",
    "Seq2SeqCollator": "meshtrain.data.collators",
    "MaskedLMCollator": "meshtrain.data.collators",
    "TokenClassificationCollator": "meshtrain.data.collators",
    "ChatCollator": "meshtrain.data.chat_data",
    "FlatteningCollator": "meshtrain.data.packing",
    "PackedDataset": "meshtrain.data.packing",
    "ChatTemplate": "meshtrain.data.chat_data",
}

__all__ = [
    "ByteTokenizer",
    "CausalLMCollator",
    "ChatCollator",
    "ChatTemplate",
    "DistributedSampler",
    "FlatteningCollator",
    "MaskedLMCollator",
    "PackedDataset",
    "PaddingCollator",
    "PrepareResult",
    "ResumableDataLoader",
    "Seq2SeqCollator",
    "TokenClassificationCollator",
    "TokenDataset",
    "TokenStore",
    "as_tokenizer",
    "load_tokenizer",
    "prepare",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'meshtrain.data' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)  # not cached: no module state


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # pragma: no cover
    from meshtrain.data.chat_data import ChatCollator, ChatTemplate
    from meshtrain.data.collators import (
        CausalLMCollator,
        MaskedLMCollator,
        PaddingCollator,
        Seq2SeqCollator,
        TokenClassificationCollator,
    )
    from meshtrain.data.loader import ResumableDataLoader
    from meshtrain.data.packing import FlatteningCollator, PackedDataset
    from meshtrain.data.prepare_store import PrepareResult, prepare
    from meshtrain.data.sampler import DistributedSampler
    from meshtrain.data.store import TokenDataset, TokenStore
    from meshtrain.data.tokenizer import ByteTokenizer, as_tokenizer, load_tokenizer

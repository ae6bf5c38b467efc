"""Which models keep packed documents apart, and what a packed batch must look like for them.

A packed row (``meshtrain.data.packing``) is only correct if the model masks attention
block-diagonally from its ``position_ids``. meshtrain's Decoder does (``document_ids``
from the restarts). transformers 5.24 does it in ``masking_utils``
(``find_packed_sequence_indices``: a new document wherever the position does not go up by
one) for the families whose mask is built by ``create_causal_mask(..., position_ids=)``,
but only when three things hold, each of which fails silently otherwise (measured on
tiny Llama / Qwen2 / Mistral / GPT-2, sdpa: logits move by 0.07-0.2 against the documents
run one per row):

* no ``attention_mask`` (an all-ones 2-D mask switches the detection off);
* no cache: ``use_cache`` defaults to ``config.use_cache`` (True for most checkpoints),
  the model then builds a ``DynamicCache`` and the detection is skipped. transformers'
  own Trainer sets ``model.config.use_cache = args.use_cache`` (False) for this reason;
* an attention implementation whose mask comes from ``masking_utils`` (sdpa, eager,
  flex); flash attention reads the boundaries from ``position_ids`` itself.

``check_packed_batch`` enforces that on a batch: it adds ``use_cache=False``, drops an
all-ones ``attention_mask``, and refuses by name a padding mask, ``use_cache=True``, an
implementation that gets no mask, and a family not verified here. ``PACKING_FAMILIES``
lists the ``model_type`` values verified with tests/data/test_packing.py (each family's
room declares its own, ``Room.packing_types`` in ``meshtrain.families``) (packed logits
equal to one document per row); OPT, for one, derives its positions from the attention
mask and does not honour packed ``position_ids``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshtrain.data.packing import is_packed
from meshtrain.errors import ConfigError
from meshtrain.families.rooms import ROOMS

PACKING_FAMILIES = frozenset(t for room in ROOMS for t in room.packing_types)
"""transformers ``model_type`` values whose packed batches are proven document-exact."""

FLASH_PREFIX = "flash_attention"


def _transformers_config(model: Any) -> Any:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        return None
    return config if hasattr(config, "_attn_implementation") else None


def check_packed_batch(model: Any, batch: Any) -> Any:
    """``batch`` ready for ``model`` when it is packed (module docstring); unchanged when
    it is not packed, not a mapping, or the model is not a transformers model (meshtrain's
    Decoder masks from ``position_ids`` itself; a user's own module keeps its contract)."""
    if not isinstance(batch, Mapping) or not is_packed(batch.get("position_ids")):
        return batch
    config = _transformers_config(model)
    if config is None:
        _check_restarts_at_zero(model, batch["position_ids"])
        return batch
    name = type(model).__name__
    family = config.model_type
    if family not in PACKING_FAMILIES:
        raise ConfigError(
            f"packed batch (position_ids restart inside a row) for {name} (model_type "
            f"{family!r}): this family is not verified to keep packed documents apart in "
            f"transformers' masks (verified: {sorted(PACKING_FAMILIES)}); train it on "
            "unpacked rows (DataCollatorWithPadding) instead of DataCollatorWithFlattening "
            "/ padding_free / packing"
        )
    impl = config._attn_implementation or "eager"
    from meshtrain.parallel.context.transformers_attention import ATTN_NAME

    if impl == ATTN_NAME:  # context parallelism masks documents itself, from the restarts
        _check_restarts_at_zero(None, batch["position_ids"])
    elif not impl.startswith(FLASH_PREFIX):
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        if impl not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            raise ConfigError(
                f"packed batch for {name}: attention implementation {impl!r} gets no mask "
                "from transformers, so packed documents would attend to each other; use "
                'attn_implementation="sdpa" (or "eager", "flex_attention", flash attention)'
            )
    batch = dict(batch)
    if batch.get("use_cache"):
        raise ConfigError(
            f"packed batch for {name}: use_cache=True makes transformers skip the packed-"
            "document mask (documents would attend to each other); drop use_cache from the "
            "batch"
        )
    batch["use_cache"] = False
    mask = batch.get("attention_mask")
    if mask is not None:
        if mask.dim() == 2 and bool(mask.all()):
            del batch["attention_mask"]  # says nothing, and would switch the detection off
        else:
            raise ConfigError(
                f"packed batch for {name}: it carries an attention_mask with padding (or a "
                "4-D mask), and transformers then ignores the packed position_ids; pack "
                "without padding (DataCollatorWithFlattening, meshtrain PackedDataset) and "
                "drop attention_mask"
            )
    return batch


def _check_restarts_at_zero(model: Any, position_ids: Any) -> None:
    """meshtrain's Decoder, and context parallelism for any model (``model`` None), find
    a document where the position restarts at 0 (that rule survives context-parallel
    chunking); a packed row whose positions jump elsewhere (``position_ids_start=1``, a
    document continued from another row) would be read as fewer documents, so it is
    refused rather than attended across."""
    from meshtrain.models.decoder import Decoder

    if model is not None and not isinstance(model, Decoder):
        return
    jumps = position_ids[..., 1:] - position_ids[..., :-1] != 1
    if bool((jumps & (position_ids[..., 1:] != 0)).any()):
        raise ConfigError(
            f"packed batch for {'Decoder' if model is not None else 'context parallelism'}: "
            "its position_ids jump to a value other than 0 inside a row, but a document "
            "starts only where the position restarts at 0; number every document's "
            "positions from 0 (position_ids_start=0)"
        )


__all__ = ["PACKING_FAMILIES", "check_packed_batch"]

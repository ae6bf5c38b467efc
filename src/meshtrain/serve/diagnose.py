"""Why a ``save_pretrained`` folder does not load, in words that name the file and the fix.

``from_pretrained`` reports these cases in its own terms: a folder without weights ("no
file named model.safetensors ..."), a damaged safetensors file ("Error while deserializing
header"), weights of another model ("You set ``ignore_mismatched_sizes`` to False ... look
at the above report", the report being a table logged somewhere above), a tokenizer JSON
file that does not parse (the JSON error with no file name or line). Each function here returns
the message ``meshtrain serve`` raises instead, or None when the case is not its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def missing_weights(folder: Path) -> str | None:
    """A folder with config.json but no weight file at all."""
    if any((folder / name).is_file() for name in WEIGHT_FILES):
        return None
    held = sorted(p.name for p in folder.iterdir())[:8]
    return (
        f"{folder} has config.json but no weights (none of {', '.join(WEIGHT_FILES)}; it "
        f"holds {held}); save the model into it with model.save_pretrained, or pass the "
        "folder that holds the weights"
    )


def damaged_weights(folder: Path, exc: BaseException) -> str | None:
    """A safetensors file that is truncated or not safetensors at all."""
    text = str(exc)
    if "deserializing header" not in text and "HeaderTooSmall" not in text:
        return None
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    return (
        f"{folder}/{files[0] if len(files) == 1 else '*.safetensors'} is damaged (truncated "
        f"or not a safetensors file: {text}); save the model again with save_pretrained, or "
        "copy the file again"
    )


def shape_mismatch(folder: Path, auto: Any, config: Any, limit: int = 3) -> str | None:
    """config.json and the weights of another model: name the tensors whose shapes differ.

    The model is built on the meta device (no memory) and compared with the shapes in the
    safetensors headers (no tensor is read)."""
    import torch
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    with torch.device("meta"):
        model = auto.from_config(config)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    diffs = []
    for f in files:
        with safe_open(str(f), "pt") as h:
            for key in h.keys():  # noqa: SIM118 - safe_open is not a mapping
                shape = tuple(h.get_slice(key).get_shape())
                expected = want.get(key, want.get(prefix + key))
                if expected is not None and expected != shape:
                    diffs.append(f"{key}: {f.name} has {list(shape)}, config.json {list(expected)}")
    if not diffs:
        return None
    return (
        f"{folder}: the weights do not fit config.json: {len(diffs)} tensor(s) differ in "
        f"shape ({'; '.join(diffs[:limit])}{'; ...' if len(diffs) > limit else ''}). The "
        "config and the weights come from different models: save both from one model with "
        "save_pretrained"
    )


def bad_json(folder: Path, names: tuple[str, ...], fix: str) -> str | None:
    """The first of the JSON files ``names`` in ``folder`` that does not parse, with its
    line and column, and ``fix``."""
    for name in names:
        path = folder / name
        if not name.endswith(".json") or not path.is_file():
            continue
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            where = f"{path}:{exc.lineno}:{exc.colno}" if hasattr(exc, "lineno") else str(path)
            return f"{where}: not valid JSON ({exc}); {fix}"
    return None

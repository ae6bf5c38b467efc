"""Text classification for ``POST /classify``: texts -> ``{"label", "score", "truncated"}``.

The numbers are those of ``transformers.pipeline("text-classification")`` (its default
``top_k=1`` answer): logits in float32, then sigmoid when the model has one label or is
multi-label, softmax otherwise; the label is ``id2label`` of the highest score.

Batching pads to the longest text of the batch with the attention mask set, so a text's
logits are those it gets alone up to float summation order (~1e-7 in fp32 here; the
tests allow 1e-6). A text longer than the model's context is cut to it, keeping the
special tokens, and answered with ``"truncated": true`` rather than refused: a
classifier's verdict on the first ``context`` tokens is what users of the pipeline
with ``truncation=True`` get.
"""

from __future__ import annotations

from typing import Any

import torch

from meshtrain.serve.model_loading import ServedModel


class Classifier:
    """Runs one batch of texts through a sequence-classification model."""

    def __init__(self, served: ServedModel) -> None:
        self.model = served.model
        self.tokenizer = served.tokenizer
        self.max_length = served.context_length
        cfg = self.model.config
        self.id2label = {int(k): v for k, v in (cfg.id2label or {}).items()}
        self.sigmoid = cfg.num_labels == 1 or cfg.problem_type == "multi_label_classification"
        self.device = next(self.model.parameters()).device
        if self.tokenizer.pad_token is None:  # padding a batch needs one (GPT-2 style vocab)
            pad = cfg.pad_token_id if cfg.pad_token_id is not None else self.tokenizer.eos_token_id
            self.tokenizer.pad_token_id = pad
            cfg.pad_token_id = pad

    def _truncated(self, texts: list[str], lengths: list[int]) -> list[bool]:
        if self.max_length is None:
            return [False] * len(texts)
        # only a text that fills the context can have been cut: tokenize just those again
        return [
            n >= self.max_length
            and len(self.tokenizer(t, truncation=False)["input_ids"]) > self.max_length
            for t, n in zip(texts, lengths, strict=True)
        ]

    @torch.inference_mode()
    def __call__(self, texts: list[str]) -> list[dict[str, Any]]:
        """``[{"label", "score", "truncated"}]``, one per text, in order."""
        enc = self.tokenizer(
            texts,
            padding=True,
            truncation=self.max_length is not None,
            max_length=self.max_length,
            return_tensors="pt",
        )
        lengths = enc["attention_mask"].sum(dim=1).tolist()
        logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits.float()
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        best, idx = scores.max(dim=-1)
        cut = self._truncated(texts, lengths)
        return [
            {"label": self.id2label.get(i, f"LABEL_{i}"), "score": s, "truncated": c}
            for i, s, c in zip(idx.tolist(), best.tolist(), cut, strict=True)
        ]

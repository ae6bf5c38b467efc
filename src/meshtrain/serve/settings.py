"""``ServeSettings``: the limits and defaults of one server (the ``meshtrain serve``
flags), checked when they are made: a bad value raises ``ServeError`` naming the field."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.errors import ServeError

CONTEXT_OVERFLOW = ("drop-oldest", "error")


@dataclass
class ServeSettings:
    """Limits and defaults of one server (the ``meshtrain serve`` flags)."""

    max_batch_size: int = 32  # classification texts per forward pass; 1 = no batching
    max_wait_ms: float = 5.0  # how long a batch waits to fill
    max_batch_queue: int = 4096  # classification texts waiting before 503
    max_texts: int = 256  # texts in one /classify request
    max_new_tokens: int = 256  # default and upper bound of a chat answer's tokens
    max_queue: int = 16  # chat requests waiting for the generation worker before 503
    chat_batch_size: int = 16  # chat sequences decoded together; 1 = one at a time
    prefill_chunk: int = 256  # prompt tokens one batched forward carries at most
    kv_blocks: int | None = None  # paged cache blocks (16 tokens); None: batch x context
    context_overflow: str = "drop-oldest"  # or "error": 422 when history outgrows the context
    timeout_s: float = 60.0  # a request waiting longer gets 504
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    retry_after_s: int = 1  # the Retry-After a 503 sends
    chat_format: str = "meshtrain"  # turn format when the tokenizer has no chat template
    model_name: str = "meshtrain"  # the "model" OpenAI responses name

    def __post_init__(self) -> None:
        if self.context_overflow not in CONTEXT_OVERFLOW:
            raise ServeError(
                f"context_overflow {self.context_overflow!r} is not a policy; use one of "
                f"{list(CONTEXT_OVERFLOW)} (meshtrain serve --context-overflow)"
            )
        for name, why in (("chat_batch_size", " (1 turns batching off)"), ("prefill_chunk", "")):
            if getattr(self, name) < 1:
                raise ServeError(f"{name} {getattr(self, name)} must be >= 1{why}")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ServeError(f"kv_blocks {self.kv_blocks} must be >= 1 (or None: batch x context)")

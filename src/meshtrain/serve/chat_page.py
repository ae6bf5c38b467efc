"""``GET /chat``: a chat page in the browser, one static HTML file with its JavaScript.

No build step and no external network: ``static/chat.html`` holds the markup, the style
and the script, and the page talks only to the server that sent it
(``POST /v1/chat/completions`` with ``"stream": true`` and
``stream_options.include_usage``). It keeps the conversation in the page (sent back as
``messages`` each turn), offers a system prompt, temperature, top-p and max new tokens,
and shows each answer's tokens, tokens/s, time to first token, finish reason and any
history rounds the server dropped to fit the context.
"""

from __future__ import annotations

import html
from functools import cache
from importlib.resources import files


@cache
def _template() -> str:
    return files("meshtrain.serve").joinpath("static", "chat.html").read_text(encoding="utf-8")


def page(model_name: str, max_new_tokens: int) -> str:
    """The page for a server named ``model_name`` whose answers are capped at
    ``max_new_tokens`` (the form's default is the smaller of that and 128)."""
    return (
        _template()
        .replace("__MODEL__", html.escape(model_name))
        .replace("__MAX_NEW__", str(max_new_tokens))
        .replace("__DEFAULT_NEW__", str(min(max_new_tokens, 128)))
    )

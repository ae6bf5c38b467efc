"""Text the trained model writes at the end of ``meshtrain train``: greedy and sampled.

The prompt is the start of the first held-out document (``PROMPT_CHARS`` characters), so
the model continues text it was never trained on. Its ids are ``[EOS] + prompt``: in
training, documents are joined with EOS, so an EOS is what precedes the start of a
paragraph and the prompt is read as one. Each new token comes from one forward of the
reference decoder over the last ``max_seq_len`` tokens (no key/value cache: a few dozen
forwards of a small model), until ``tokens`` tokens or an EOS.

* greedy: the most likely token each time (ties: the lowest id, ``argmax``'s rule);
* sampled: softmax at ``TEMPERATURE``, restricted to the ``TOP_K`` most likely tokens,
  drawn with a ``torch.Generator`` seeded with ``model.seed``, so a run prints the same
  sample again from the same weights.

The model runs wherever its weights are (rank 0's device), in eval mode, without
gradients.
"""

from __future__ import annotations

from typing import Any

import torch

PROMPT_CHARS = 12
TEMPERATURE = 0.8
TOP_K = 40


def prompt_text(heldout_document: str) -> str:
    """The sample's prompt: the first ``PROMPT_CHARS`` characters of a held-out document."""
    return heldout_document[:PROMPT_CHARS]


@torch.no_grad()
def continue_text(
    model: torch.nn.Module,
    prompt_ids: list[int],
    tokens: int,
    eos_id: int,
    context: int,
    *,
    seed: int | None = None,
) -> list[int]:
    """The ids generated after ``prompt_ids``: greedy when ``seed`` is None, else sampled
    (module docstring)."""
    device = next(model.parameters()).device
    training = model.training
    model.eval()
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    ids = list(prompt_ids)
    out: list[int] = []
    try:
        for _ in range(tokens):
            window = torch.tensor([ids[-context:]], device=device)
            logits = model(window)[0, -1].float()  # [vocab]
            if generator is None:
                nxt = int(logits.argmax())
            else:
                top = torch.topk(logits / TEMPERATURE, min(TOP_K, logits.numel()))
                probs = torch.softmax(top.values, dim=-1)
                nxt = int(top.indices[torch.multinomial(probs, 1, generator=generator)])
            if nxt == eos_id:
                break
            ids.append(nxt)
            out.append(nxt)
    finally:
        model.train(training)
    return out


def samples(model: torch.nn.Module, tokenizer: Any, prompt: str, tokens: int, seed: int) -> dict:
    """``{"prompt", "greedy", "sampled", "how"}``: the two continuations of ``prompt``."""
    context = int(model.config.max_seq_len)
    ids = [tokenizer.eos_id, *tokenizer.encode(prompt, add_special_tokens=False)]
    greedy = continue_text(model, ids, tokens, tokenizer.eos_id, context)
    sampled = continue_text(model, ids, tokens, tokenizer.eos_id, context, seed=seed)
    return {
        "prompt": prompt,
        "greedy": tokenizer.decode(greedy),
        "sampled": tokenizer.decode(sampled),
        "how": f"temperature {TEMPERATURE}, top-k {TOP_K}, seed {seed}",
    }


__all__ = ["PROMPT_CHARS", "TEMPERATURE", "TOP_K", "continue_text", "prompt_text", "samples"]

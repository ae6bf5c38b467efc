"""A ``transformers`` causal LM run over the paged cache (``paged_kv``): one forward of a
step's tokens laid end to end (:class:`PagedForward`), and the start-up checks that the
model can be continuously batched (:func:`blocker`: its ``generation_config`` asks for
nothing the batcher does not implement, and :func:`probe`: its logits come out the same
that way).

The attention implementation is switched to ``meshtrain_paged`` on the model's config
for the length of each paged forward only, so ``model.generate`` elsewhere is untouched;
the batcher's thread owns the model while it serves (nothing else may run the same
model object at the same time: a forward that met the switch would find no step plan
and raise ``PagedUnsupported``)."""

from __future__ import annotations

from typing import Any

import torch

from meshtrain.serve.paged_kv import (
    ATTN_NAME,
    BlockPool,
    PagedSeq,
    PagedUnsupported,
    plan_step,
    register,
)


class PagedForward:
    """One forward of a step's tokens laid end to end (``paged_kv`` module docstring):
    ``(ids, chunks, decoding, pool, keep)`` -> logits of the rows in ``keep``."""

    def __init__(self, model: Any, context: int | None) -> None:
        register()
        self.model = model
        self.context = context
        self.device = next(model.parameters()).device
        self.keep_arg = "logits_to_keep" in _forward_params(model)
        # a ready 4-D mask: transformers then builds none (paged_attention ignores it)
        self.mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)

    def __call__(
        self,
        ids: torch.Tensor,
        chunks: list[tuple[PagedSeq, int]],
        decoding: list[PagedSeq],
        pool: BlockPool,
        keep: list[int],
    ) -> torch.Tensor:
        positions = [s.length for s in decoding]
        for s, n in chunks:
            positions += range(s.length, s.length + n)
        plan = plan_step(pool, decoding, chunks, self.device, self.context)
        kw: dict[str, Any] = {}
        rows = torch.tensor(keep, dtype=torch.long, device=self.device)
        if self.keep_arg:
            kw["logits_to_keep"] = rows
        config = self.model.config
        before = config._attn_implementation
        config._attn_implementation = ATTN_NAME  # only for this forward
        try:
            out = self.model(
                input_ids=ids[None],
                position_ids=torch.tensor([positions], device=self.device),
                attention_mask=self.mask,
                use_cache=False,
                meshtrain_plan=plan,
                **kw,
            )
        finally:
            config._attn_implementation = before
        logits = out.logits[0]
        return logits if self.keep_arg else logits[rows]


def probe(model: Any, context: int | None = None) -> str | None:
    """Why ``model`` cannot run over the paged cache, or None: a short sequence goes
    through :class:`PagedForward` (a prefill in two chunks, then a decoding step, in
    4-token blocks) and its logits are compared with a plain forward's. A model whose
    attention does not go through ``transformers``' attention interface, or needs what
    the paged kernel does not do (``PagedUnsupported``), fails."""
    device = next(model.parameters()).device
    vocab = int(getattr(model.config, "vocab_size", None) or 2)
    ids = (torch.arange(8, device=device) * 7 + 1) % vocab
    try:
        with torch.inference_mode():
            want = model(input_ids=ids[None], use_cache=False).logits[0, 6:8].float()
            pool, seq = BlockPool(block_size=4, max_blocks=8, initial=1), PagedSeq()
            runner = PagedForward(model, context)
            runner(ids[:5], [(seq, 5)], [], pool, keep=[4])
            got6 = runner(ids[5:7], [(seq, 2)], [], pool, keep=[1])[0]
            got7 = runner(ids[7:8], [], [seq], pool, keep=[0])[0]
    except PagedUnsupported as exc:
        return f"paged attention cannot serve {type(model).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 -- any failure means: not this model
        return f"paged attention failed on {type(model).__name__}: {type(exc).__name__}: {exc}"
    got = torch.stack([got6, got7]).float()
    # fp32: summation order only; bf16/fp16 round every product (the dtype caveat)
    exact = next(model.parameters()).dtype == torch.float32
    tol = (1e-4 if exact else 3e-2) * max(1.0, want.abs().max().item())
    err = (got - want).abs().max().item()
    if not err <= tol:
        return (
            f"paged attention does not reproduce {type(model).__name__}'s logits "
            f"(max difference {err:.3g} > {tol:.3g}): its attention does not go through "
            "transformers' attention interface"
        )
    return None


def _forward_params(model: Any) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)


# generation_config fields this loop does not implement, with the value that means "off"
_UNSUPPORTED = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "penalty_alpha": None,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "min_length": 0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "min_p": None,
    "guidance_scale": None,
    "stop_strings": None,
    "exponential_decay_length_penalty": None,
    "renormalize_logits": False,
}


def blocker(model: Any, context: int | None = None) -> str | None:
    """Why ``model`` cannot be continuously batched (``continuous``' docstring), or None.

    Besides the ``generation_config`` options, the model must pass
    :func:`~meshtrain.serve.paged_model.probe` (the paged forward reproduces its
    logits)."""
    gen = model.generation_config
    for name, off in _UNSUPPORTED.items():
        value = getattr(gen, name, off)
        if value not in (off, None) and not (name == "min_length" and value == 0):
            return f"generation_config.{name}={value!r} is not implemented by continuous batching"
    return probe(model, context)

"""Continuous batching of chat generation: sequences join and leave at every decoding step.

One worker thread owns the model. Each turn of its loop:

1. **Admit.** Requests waiting in the bounded queue (``max_queue`` places, filled while
   a step runs; full -> ``QueueFull``, answered 503 with ``Retry-After``) join while
   fewer than ``max_batch`` sequences run.
   The newcomers' prompts are prefilled together in one forward (left-padded to the
   longest, each row with its own positions; a lone newcomer is prefilled exactly as
   ``model.generate`` prefills it), their first tokens chosen, and their cache rows join
   the running batch (``kv_batch.PaddedKV``: left padding, one row per sequence).
2. **Decode.** One forward of every running sequence's last token (``[B, 1]``), with the
   padding mask and each row's own positions; each row's next token is chosen with its
   own sampling parameters (greedy argmax, or temperature / top-k / top-p sampling) and
   ``min_new_tokens`` (EOS suppressed before it, as ``generate`` does).
3. **Leave.** A sequence stops at its own EOS, at its own ``max_new_tokens`` (already
   capped at the context), or when its request is cancelled (504 or the client went
   away); it is answered at once and its row is dropped before the next step.

So a request waits for at most one decoding step (plus the prefills admitted with it)
before it starts, never for another request to finish. Streaming pushes each sequence's
text (``stops.AnswerText``) as its tokens are chosen, and ends it at its own stop strings.

Equality with ``model.generate``. A row's keys and values, positions and causal window
are exactly its own, and padded columns get zero attention weight, so a greedy answer
equals what ``model.generate`` gives the prompt alone -- up to floating-point summation
order: batched matrix products (and attention over padded columns) may reduce in a
different order than the batch-1 ones, so logits can differ in the last bits. In fp32
that never changed an argmax in the tests (50 mixed-length prompts, exact equality); in
bf16/fp16 two logits within one rounding step of each other can swap, and a greedy
answer may then diverge from its batch-1 answer after that token (vLLM and TGI carry the
same caveat).

What is not batched. ``generation_config`` options beyond EOS, ``min_new_tokens``,
``temperature``, ``top_k`` and ``top_p`` (beam search, repetition penalties, forced or
suppressed tokens, ...), and models whose cache is not plain full attention (sliding
windows, recurrent layers), are served one sequence at a time by ``model.generate``
(``blocker`` names the reason; ``GET /`` and the log show it).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from meshtrain.serve.generation import _STOP, GenerationJob, JobQueue
from meshtrain.serve.kv_batch import PaddedKV, cache_kwarg, output_cache, supports

log = logging.getLogger("meshtrain.serve")

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


def blocker(model: Any) -> str | None:
    """Why ``model`` cannot be continuously batched (module docstring), or None."""
    from transformers import DynamicCache

    gen = model.generation_config
    for name, off in _UNSUPPORTED.items():
        value = getattr(gen, name, off)
        if value not in (off, None) and not (name == "min_length" and value == 0):
            return f"generation_config.{name}={value!r} is not implemented by continuous batching"
    device = next(model.parameters()).device
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
    if not supports(output_cache(out)):
        return f"{type(model).__name__}'s cache is not plain full attention (sliding or recurrent)"
    return None


@dataclass
class Sequence:
    """One running request: its tokens so far and its own stop and sampling settings."""

    job: GenerationJob
    n_prompt: int
    max_new: int
    min_new: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    text: Any = None  # stops.AnswerText when it streams or has stop strings
    tokens: list[int] = field(default_factory=list)


class ContinuousBatcher(JobQueue):
    """The worker of chat generation with continuous batching (module docstring).

    Same interface as :class:`~meshtrain.serve.generation.GenerationWorker`: ``submit``,
    ``waiting``, ``done``, ``close``; plus ``running`` (sequences in the batch now) and
    ``tokens`` (generated so far). ``on_step(batch_size)`` is called after every
    decoding step (metrics)."""

    def __init__(
        self,
        chat: Any,
        *,
        max_batch: int = 16,
        max_queue: int = 16,
        on_step: Callable[[int], None] | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.chat = chat
        self.model = chat.model
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.on_step = on_step
        self.done = 0
        self.tokens = 0
        self.steps = 0  # decoding steps
        self.prefills = 0  # prefill forwards (several newcomers may share one)
        self._cache_arg = cache_kwarg(self.model)
        self._sdpa = getattr(self.model.config, "_attn_implementation", None) == "sdpa"
        self._keep_arg = "logits_to_keep" in _forward_params(self.model)
        self._seqs: list[Sequence] = []
        self._kv = PaddedKV()
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._loop, name="meshtrain-batch", daemon=True)
        self._thread.start()

    @property
    def running(self) -> int:
        return len(self._seqs)

    # -- the worker thread -------------------------------------------------------------
    @torch.inference_mode()
    def _loop(self) -> None:
        stopping = False
        while not stopping:
            new: list[GenerationJob] = []
            if not self._seqs:
                item = self._queue.get()  # idle: sleep until a request comes
                if item is _STOP:
                    break
                new.append(item)
            while len(self._seqs) + len(new) < self.max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stopping = True
                    break
                new.append(item)
            try:
                self._admit(new)
                if self._seqs and not stopping:
                    self._step()
            except Exception as exc:  # a bug here must not kill the worker: fail, go on
                log.exception("continuous batching failed")
                for seq in self._seqs:
                    self._finish(seq.job, error=exc)
                self._seqs, self._kv = [], PaddedKV()
        for seq in self._seqs:  # shutting down: nobody will read these answers
            self._finish(seq.job, error=asyncio.CancelledError())
        self._seqs, self._kv = [], PaddedKV()

    def _sequence(self, job: GenerationJob) -> Sequence:
        gen = self.model.generation_config
        kw = job.kwargs

        def pick(name: str, default: Any) -> Any:
            value = kw.get(name)
            if value is None:
                value = getattr(gen, name, None)
            return default if value is None else value

        return Sequence(
            job=job,
            n_prompt=len(job.input_ids),
            max_new=int(kw["max_new_tokens"]),
            min_new=int(getattr(gen, "min_new_tokens", None) or 0),
            do_sample=bool(kw.get("do_sample", False)),
            temperature=float(pick("temperature", 1.0)),
            top_k=int(pick("top_k", 0)),
            top_p=float(pick("top_p", 1.0)),
            text=self.chat.answer_text(job),
        )

    def _forward(self, ids: torch.Tensor, cache: Any, **kw: Any) -> Any:
        if self._keep_arg:
            kw["logits_to_keep"] = 1
        return self.model(input_ids=ids, use_cache=True, **{self._cache_arg: cache}, **kw)

    def _admit(self, jobs: list[GenerationJob]) -> None:
        """Prefill ``jobs`` in one forward and add those that go on to the batch."""
        from transformers import DynamicCache

        seqs = []
        for job in jobs:
            if job.cancelled.is_set():
                self._finish(job, error=asyncio.CancelledError())
                continue
            try:
                seqs.append(self._sequence(job))
            except Exception as exc:  # a bad request fails alone
                self._finish(job, error=exc)
        if not seqs:
            return
        width = max(s.n_prompt for s in seqs)
        device = self.chat.device
        ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for row, s in enumerate(seqs):  # left padding: every prompt ends in the last column
            ids[row, width - s.n_prompt :] = torch.tensor(s.job.input_ids, device=device)
            mask[row, width - s.n_prompt :] = 1
        kw: dict[str, Any] = {"attention_mask": mask}
        if len(seqs) > 1:  # positions count real tokens only (as generate's batched inputs)
            kw["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        try:
            out = self._forward(ids, DynamicCache(config=self.model.config), **kw)
            tokens = self._choose(out.logits[:, -1, :], seqs)
        except Exception as exc:  # these requests fail; the running batch goes on
            log.exception("prefill failed")
            for s in seqs:
                self._finish(s.job, error=exc)
            return
        self.prefills += 1
        self._kv.join(output_cache(out), mask)
        rows = [self._kv.rows - len(seqs) + i for i in range(len(seqs))]
        self._seqs += seqs
        going = [self._advance(s, t) for s, t in zip(seqs, tokens, strict=True)]
        if not all(going):  # some finished on their first token: drop their rows
            keep = list(range(len(self._seqs) - len(seqs)))
            keep += [r for r, g in zip(rows, going, strict=True) if g]
            self._seqs = [self._seqs[i] for i in keep]
            self._kv.keep(keep)

    def _step(self) -> None:
        keep = [i for i, s in enumerate(self._seqs) if not s.job.cancelled.is_set()]
        for i in sorted(set(range(len(self._seqs))) - set(keep)):
            self._finish(self._seqs[i].job, error=asyncio.CancelledError())
        self._seqs = [self._seqs[i] for i in keep]
        self._kv.keep(keep)
        if not self._seqs:
            return
        last = torch.tensor([[s.tokens[-1]] for s in self._seqs], device=self.chat.device)
        mask, positions = self._kv.step_inputs()
        try:
            # sdpa takes a ready boolean [B, 1, 1, T + 1] mask (True = attend): transformers
            # then skips building one from the 2-D mask at every step
            ready = mask[:, None, None, :].bool() if self._sdpa else mask
            out = self._forward(last, self._kv.cache, attention_mask=ready, position_ids=positions)
            tokens = self._choose(out.logits[:, -1, :], self._seqs)
        except Exception as exc:  # the batched forward failed: every running request learns why
            log.exception("decoding step failed")
            for seq in self._seqs:
                self._finish(seq.job, error=exc)
            self._seqs, self._kv = [], PaddedKV()
            return
        self._kv.stepped(mask)
        self.steps += 1
        batch = len(self._seqs)
        keep = [
            i
            for i, (s, t) in enumerate(zip(self._seqs, tokens, strict=True))
            if self._advance(s, t)
        ]
        self._seqs = [self._seqs[i] for i in keep]
        self._kv.keep(keep)
        if self.on_step is not None:
            self.on_step(batch)

    def _advance(self, seq: Sequence, token: int) -> bool:
        """Append ``token`` to ``seq``; answer it and return False when it is finished."""
        seq.tokens.append(token)
        self.tokens += 1
        eos = token in self.chat.eos_ids
        stop = eos or (seq.text is not None and seq.text.add(token))
        if not (stop or len(seq.tokens) >= seq.max_new or seq.job.cancelled.is_set()):
            return True
        from meshtrain.serve.chat import Answer

        if seq.text is not None:
            text = seq.text.finish()
        else:
            text = self.chat.tokenizer.decode(seq.tokens, skip_special_tokens=True)
        answer = Answer(
            text=text,
            prompt_tokens=seq.n_prompt,
            completion_tokens=len(seq.tokens),
            finish_reason="stop" if stop else "length",
            token_ids=list(seq.tokens),
        )
        self.done += 1
        self._finish(seq.job, answer)
        return False

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Each row's next token under its own settings (``[B, vocab]`` logits)."""
        logits = logits.float()
        eos = sorted(self.chat.eos_ids)
        suppress = [i for i, s in enumerate(seqs) if len(s.tokens) < s.min_new]
        if suppress and eos:  # min_new_tokens: EOS cannot win yet (generate's processor)
            logits[torch.tensor(suppress)[:, None], torch.tensor(eos)[None, :]] = -float("inf")
        out = logits.argmax(dim=-1).tolist()
        for i, s in enumerate(seqs):
            if s.do_sample:
                out[i] = _sample(logits[i], s.temperature, s.top_k, s.top_p)
        return out


def _sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> int:
    """One token from ``logits`` (``[vocab]``) as ``generate`` samples: temperature, then
    top-k, then top-p (keeping at least one token), then a draw from the softmax."""
    if temperature != 1.0:
        logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if top_p < 1.0:
        ordered, index = torch.sort(logits, descending=False)
        cum = ordered.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[-1] = False
        logits = logits.masked_fill(drop.scatter(0, index, drop), -float("inf"))
    return int(torch.multinomial(logits.softmax(-1), 1))


def _forward_params(model: Any) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)

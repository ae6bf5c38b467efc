"""Continuous batching of chat generation: sequences join and leave at every step.

One worker thread owns the model. Each turn of its loop:

1. **Admit.** Requests waiting in the bounded queue (``max_queue`` places, filled while
   a step runs; full -> ``QueueFull``, answered 503 with ``Retry-After``) are admitted,
   oldest first, while fewer than ``max_batch`` sequences run and the paged cache
   (``paged_kv.BlockPool``) has the blocks their prompt and whole answer may need; those
   blocks are reserved then and taken as the sequence grows.
2. **Step.** One forward carries every running sequence's new tokens laid end to end:
   the last token of each decoding sequence, and a chunk of prompt for each sequence
   still being prefilled, at most ``prefill_chunk`` prompt tokens in all (the oldest
   first). A joining request is therefore prefilled *inside* the decoding step of the
   others -- it never costs them a forward of its own, and a long prompt is cut so that
   no step carries more than ``prefill_chunk`` prompt tokens. Each sequence that gets a
   token (a decoding one, or one whose prompt ended in this chunk) has it chosen with
   its own sampling parameters (greedy argmax, or temperature / top-k / top-p sampling)
   and ``min_new_tokens`` (EOS suppressed before it, as ``generate`` does).
3. **Leave.** A sequence stops at its own EOS, at its own ``max_new_tokens`` (already
   capped at the context), at one of its stop strings (``stops.AnswerText``, on the
   decoded text), or when its request is cancelled (504 or the client went away); it is
   answered at once and its blocks go back to the pool.

So a request starts at the next step, never waiting for another to finish. Streaming
pushes each sequence's text as its tokens are chosen.

Equality with ``model.generate``. A sequence's keys and values, positions and causal
window are exactly its own (``paged_kv``: its block table, its ``position_ids``), so a
greedy answer equals what ``model.generate`` gives the prompt alone -- up to
floating-point summation order: batched matrix products, a prefill split into chunks
and attention over gathered slots may reduce in a different order than the batch-1
ones, so logits can differ in the last bits. In fp32 that never changed an argmax in
the tests (50 mixed-length prompts, exact equality); in bf16/fp16 two logits within one
rounding step of each other can swap, and a greedy answer may then diverge from its
batch-1 answer after that token (vLLM and TGI carry the same caveat).

What is not batched. ``generation_config`` options beyond EOS, ``min_new_tokens``,
``temperature``, ``top_k`` and ``top_p`` (beam search, repetition penalties, forced or
suppressed tokens, ...), and models the paged attention cannot run (sliding windows
shorter than the context, softcaps, recurrent layers, attention outside
``transformers``' attention interface) are served one sequence at a time by
``model.generate``: ``paged_model.blocker`` probes for them and names the reason
(``GET /`` and the log show it).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from meshtrain.errors import ServeError
from meshtrain.serve.generation import STOP, GenerationJob, JobQueue
from meshtrain.serve.paged_kv import BlockPool, PagedSeq
from meshtrain.serve.paged_model import PagedForward

log = logging.getLogger("meshtrain.serve")


@dataclass
class Sequence:
    """One admitted request: its tokens so far, its place in the paged cache, and its own
    stop and sampling settings."""

    job: GenerationJob
    n_prompt: int
    max_new: int
    min_new: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    need: int  # blocks it holds at the end (prompt + max_new): reserved at admission
    text: Any = None  # stops.AnswerText when it streams or has stop strings
    tokens: list[int] = field(default_factory=list)
    fed: int = 0  # prompt tokens already in the cache (prefill is chunked)
    paged: PagedSeq = field(default_factory=PagedSeq)


class ContinuousBatcher(JobQueue):
    """The worker of chat generation with continuous batching (module docstring).

    Same interface as :class:`~meshtrain.serve.generation.GenerationWorker`: ``submit``,
    ``waiting``, ``done``, ``close``; plus ``running`` (sequences admitted now),
    ``tokens`` (generated so far) and ``pool`` (the paged cache's blocks).
    ``on_step(batch_size)`` is called after every forward (metrics).

    ``prefill_chunk``: prompt tokens one forward takes at most (a long prompt is
    prefilled over several steps, so running sequences never wait for more than one
    such chunk). ``block_size``, ``kv_blocks``: the paged cache (``paged_kv``); by
    default enough blocks for ``max_batch`` sequences of the whole context.

    ``inbox(block)``: where requests come from besides ``submit``, read by this worker's
    own thread at the top of every turn (``block`` is True when nothing runs: it then
    waits for the first message). It puts the jobs it reads on the queue itself. The
    split server's pipe is read this way (``split_process.serve_model``), so that no
    other thread of the model process wakes for each message and then waits for the GIL
    the decoding thread holds (that handover took 0.2 ms to 5 ms, the switch interval,
    per arriving request)."""

    def __init__(
        self,
        chat: Any,
        *,
        max_batch: int = 16,
        max_queue: int = 16,
        on_step: Callable[[int], None] | None = None,
        prefill_chunk: int = 256,
        block_size: int = 16,
        kv_blocks: int | None = None,
        inbox: Callable[[bool], None] | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.chat = chat
        self.model = chat.model
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.on_step = on_step
        self.prefill_chunk = prefill_chunk
        self.inbox = inbox
        self.done = 0
        self.tokens = 0
        self.steps = 0  # forwards run
        self.prefills = 0  # forwards that carried prompt chunks (several may share one)
        context = chat.context or 4096
        if kv_blocks is None:
            kv_blocks = max_batch * -(-context // block_size)
        self.pool = BlockPool(block_size, kv_blocks, initial=min(kv_blocks, 64))
        self._run = PagedForward(self.model, chat.context)
        eos = sorted(i for i in chat.eos_ids if i is not None)
        self._eos = torch.tensor(eos, device=chat.device) if eos else None
        self._seqs: list[Sequence] = []
        self._pending: collections.deque[GenerationJob] = collections.deque()
        self._outbox = {}  # answers and streamed pieces leave once per step (_flush)
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._loop, name="meshtrain-batch", daemon=True)
        self._thread.start()

    @property
    def running(self) -> int:
        return len(self._seqs)

    @property
    def waiting(self) -> int:  # queued, and taken but waiting for cache blocks
        return self._queue.qsize() + len(self._pending)

    # -- the worker thread -------------------------------------------------------------
    @torch.inference_mode()
    def _loop(self) -> None:
        stopping = False
        while not stopping:
            idle = not self._seqs and not self._pending
            if self.inbox is not None:  # idle: wait for a message that brings a job
                self.inbox(idle and self._queue.empty())
                while idle and self._queue.empty():
                    self.inbox(True)
            if idle:
                item = self._queue.get()  # idle: sleep until a request comes
                if item is STOP:
                    break
                self._pending.append(item)
            while len(self._seqs) + len(self._pending) < self.max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is STOP:
                    stopping = True
                    break
                self._pending.append(item)
            try:
                self._admit()
                if self._seqs and not stopping:
                    self._step()
            except Exception as exc:  # a bug here must not kill the worker: fail, go on
                log.exception("continuous batching failed")
                self._fail_all(exc)
                while self._pending:  # also those not admitted: nothing may spin on them
                    self._finish(self._pending.popleft(), error=exc)
            self._flush()
        for job in self._pending:  # shutting down: nobody will read these answers
            self._finish(job, error=asyncio.CancelledError())
        self._pending.clear()
        self._fail_all(asyncio.CancelledError())
        self._flush()

    def _fail_all(self, exc: BaseException) -> None:
        for seq in self._seqs:
            self._finish(seq.job, error=exc)
            self.pool.release(seq.paged.blocks)
        self._seqs = []

    def _sequence(self, job: GenerationJob) -> Sequence:
        gen = self.model.generation_config
        kw = job.kwargs

        def pick(name: str, default: Any) -> Any:
            value = kw.get(name)
            if value is None:
                value = getattr(gen, name, None)
            return default if value is None else value

        n_prompt, max_new = len(job.input_ids), int(kw["max_new_tokens"])
        return Sequence(
            job=job,
            n_prompt=n_prompt,
            max_new=max_new,
            min_new=int(getattr(gen, "min_new_tokens", None) or 0),
            do_sample=bool(kw.get("do_sample", False)),
            temperature=float(pick("temperature", 1.0)),
            top_k=int(pick("top_k", 0)),
            top_p=float(pick("top_p", 1.0)),
            need=self.pool.blocks_for(n_prompt + max_new),
            text=self.chat.answer_text(job),
        )

    def _admit(self) -> None:
        """Admit waiting requests, oldest first, while the batch has room and the pool
        has the blocks their whole answer may need (reserved now, taken as they grow:
        a running sequence never waits for memory)."""
        if not self._pending:
            return
        reserved = sum(s.need - len(s.paged.blocks) for s in self._seqs)
        while self._pending and len(self._seqs) < self.max_batch:
            job = self._pending[0]
            if job.cancelled.is_set():
                self._pending.popleft()
                self._finish(job, error=asyncio.CancelledError())
                continue
            try:
                seq = self._sequence(job)
                if seq.need > self.pool.max_blocks:
                    raise ServeError(
                        f"a prompt of {seq.n_prompt} tokens with {seq.max_new} new ones needs "
                        f"{seq.need} key/value blocks; the cache has {self.pool.max_blocks}"
                    )
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                self._pending.popleft()
                self._finish(job, error=exc)
                continue
            if seq.need > self.pool.available - reserved:
                return  # wait for running sequences to give blocks back (first come first)
            self._pending.popleft()
            job.post = functools.partial(self._post, job.loop)
            reserved += seq.need
            self._seqs.append(seq)

    def _step(self) -> None:
        """One forward: a token for every decoding sequence, prompt chunks for the others."""
        gone = [s for s in self._seqs if s.job.cancelled.is_set()]
        if gone:
            for s in gone:
                self._finish(s.job, error=asyncio.CancelledError())
                self.pool.release(s.paged.blocks)
            self._seqs = [s for s in self._seqs if not s.job.cancelled.is_set()]
        decoding = [s for s in self._seqs if s.fed == s.n_prompt]
        chunks: list[tuple[Sequence, int]] = []
        budget = self.prefill_chunk
        for s in self._seqs:
            if s.fed < s.n_prompt and budget > 0:
                n = min(s.n_prompt - s.fed, budget)
                chunks.append((s, n))
                budget -= n
        if not decoding and not chunks:
            return
        ids = [s.tokens[-1] for s in decoding]
        keep = list(range(len(decoding)))
        chosen = list(decoding)  # sequences that get a token from this forward
        for s, n in chunks:
            ids += s.job.input_ids[s.fed : s.fed + n]
            if s.fed + n == s.n_prompt:  # the prompt's last token: its first answer token
                keep.append(len(ids) - 1)
                chosen.append(s)
        try:
            logits = self._run(
                torch.tensor(ids, device=self.chat.device),
                [(s.paged, n) for s, n in chunks],
                [s.paged for s in decoding],
                self.pool,
                keep,
            )
            tokens = self._choose(logits, chosen)
        except Exception as exc:  # the batched forward failed: every request in it learns why
            log.exception("decoding step failed")
            self._fail_all(exc)
            return
        for s, n in chunks:
            s.fed += n
        self.steps += 1
        self.prefills += bool(chunks)
        finished = {id(s) for s, t in zip(chosen, tokens, strict=True) if not self._advance(s, t)}
        if finished:
            for s in self._seqs:
                if id(s) in finished:
                    self.pool.release(s.paged.blocks)
            self._seqs = [s for s in self._seqs if id(s) not in finished]
        if self.on_step is not None:
            self.on_step(len(decoding) + len(chunks))

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
        eos = self._eos
        suppress = [i for i, s in enumerate(seqs) if len(s.tokens) < s.min_new]
        if suppress and eos is not None:  # min_new_tokens: EOS cannot win yet (generate's)
            if len(suppress) == len(seqs):  # every row (one op instead of an index pair)
                logits.index_fill_(1, eos, -float("inf"))
            else:
                logits[torch.tensor(suppress)[:, None], eos[None, :]] = -float("inf")
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

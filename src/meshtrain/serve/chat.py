"""Chat: a prompt and its history become token ids, and ``model.generate`` answers.

Prompt format. When the tokenizer has a chat template, the conversation goes through it
(``apply_chat_template(messages, add_generation_prompt=True)``; history pairs become
user/assistant turns). Otherwise the text is built exactly as meshtrain's
``ChatCollator`` built it for training (``meshtrain.data.chat_data``)::

    [bos] + "<|user|>\\n{q1}\\n<|assistant|>\\n{a1}\\n" + ... + "<|user|>\\n{prompt}\\n<|assistant|>\\n"

(``--chat-format chatglm`` uses the seeds' ``[Round i]\\n问:...\\n答:`` turns instead), each
piece tokenized without special tokens, so a model fine-tuned with that collator is
asked the way it was taught.

Context. A conversation that outgrows the context loses its oldest history rounds first
(:meth:`Chat.fit`, the app's ``context_overflow="drop-oldest"``, the default) until
``n + reserve <= context`` with ``reserve = min(max_new_tokens, context // 2)`` tokens
left for the answer; the response says how many rounds were dropped. With
``context_overflow="error"``, or when the prompt alone is too long, a prompt (with its
history) of ``n`` tokens needs ``n < context`` to generate anything: otherwise the
request gets 422 naming ``prompt``, with both numbers.
``max_new_tokens`` is then capped at ``context - n``, and the answer says
``finish_reason: "length"`` when it stopped there.

Generation. ``do_sample`` false (the default) is greedy decoding, equal to
``model.generate(input_ids, do_sample=False, max_new_tokens=...)``; ``temperature``,
``top_p`` apply when sampling. EOS is the model's ``generation_config.eos_token_id``, or
the tokenizer's (as the collator appended it) when the model names none.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from meshtrain.serve.generation import GenerationJob
from meshtrain.serve.model_loading import ServedModel
from meshtrain.serve.stops import AnswerStreamer, AnswerText

CHAT_FORMATS = ("meshtrain", "chatglm")


class PromptTooLong(ValueError):
    """The prompt and history leave no room in the model's context (answered with 422)."""


@dataclass
class Answer:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (EOS) or "length" (max_new_tokens or the context)
    token_ids: list[int] | None = None  # the generated ids (tests compare them)


class Chat:
    """Turns conversations into ids and runs generation jobs (on the worker thread)."""

    def __init__(self, served: ServedModel, *, chat_format: str = "meshtrain") -> None:
        from transformers import StoppingCriteria, StoppingCriteriaList

        from meshtrain.data.chat_data import ChatCollator, ChatTemplate
        from meshtrain.data.tokenizer import HFTokenizer

        if chat_format not in CHAT_FORMATS:
            raise ValueError(f"chat_format must be one of {CHAT_FORMATS}, got {chat_format!r}")
        self.model = served.model
        self.tokenizer = served.tokenizer
        self.context = served.context_length
        self.device = next(self.model.parameters()).device
        self.uses_template = bool(getattr(self.tokenizer, "chat_template", None))
        template = ChatTemplate.chatglm() if chat_format == "chatglm" else ChatTemplate()
        self.chat_format = "tokenizer chat template" if self.uses_template else chat_format
        self._collator = ChatCollator(self.tokenizer, template=template, add_eos=False)
        gen = self.model.generation_config
        if gen.eos_token_id is None:
            gen.eos_token_id = HFTokenizer(self.tokenizer).eos_id
        if gen.pad_token_id is None:  # one sequence, no padding; silences generate's warning
            gen.pad_token_id = self.tokenizer.pad_token_id or gen.eos_token_id
        eos = gen.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])

        class _Stop(StoppingCriteria):  # a cancelled job, or a stop string in the text
            def __init__(self, job: GenerationJob, answer: AnswerText | None) -> None:
                self.job, self.answer = job, answer

            def __call__(self, input_ids: torch.Tensor, scores: Any, **kw: Any) -> torch.Tensor:
                stop = self.job.cancelled.is_set() or (
                    self.answer is not None and self.answer.stopped
                )
                return torch.full(
                    (input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device
                )

        self._stopping = lambda job, answer: StoppingCriteriaList([_Stop(job, answer)])

    def answer_text(self, job: GenerationJob) -> AnswerText | None:
        """The :class:`~meshtrain.serve.stops.AnswerText` that watches ``job``'s stop
        strings and streams its text; None when it neither streams nor has stops (its
        text is then decoded once, at the end)."""
        if job.stream is None and not job.stop:
            return None
        push = job.push if job.stream is not None else None
        return AnswerText(self.tokenizer, job.stop, push)

    def prompt_ids(
        self, prompt: str, history: list[tuple[str, str]], system: str | None = None
    ) -> list[int]:
        """Token ids of the conversation so far, ending where the answer starts."""
        if self.uses_template:
            messages = [{"role": "system", "content": system}] if system else []
            for q, a in history:
                messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            messages.append({"role": "user", "content": prompt})
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        record = {"prompt": prompt, "response": "", "history": [list(p) for p in history]}
        collator = self._collator
        if system:  # the template's system text goes first, once (as in training)
            template = replace(collator.template, system=system + "\n")
            collator = type(collator)(self.tokenizer, template=template, add_eos=False)
        return collator.encode(record)["input_ids"]

    def fit(
        self,
        prompt: str,
        history: list[tuple[str, str]],
        system: str | None,
        reserve: int,
    ) -> tuple[list[int], int]:
        """(ids, dropped): the conversation without its ``dropped`` oldest history rounds,
        where ``dropped`` is the fewest that leave ``reserve`` tokens of the context free
        for the answer (all of them when even that is not enough; the caller then caps
        the answer or answers 422 as without dropping). Binary search: dropping a round
        never lengthens the prompt, and each try is one tokenization."""
        ids = self.prompt_ids(prompt, history, system)
        if self.context is None or len(ids) + reserve <= self.context or not history:
            return ids, 0
        lo, hi = 1, len(history)  # the answer is in [lo, hi]: hi fits, or drops all
        best = self.prompt_ids(prompt, [], system)
        while lo < hi:
            mid = (lo + hi) // 2
            trial = self.prompt_ids(prompt, history[mid:], system)
            if len(trial) + reserve <= self.context:
                hi, best = mid, trial
            else:
                lo = mid + 1
        return best, hi  # best is the conversation without history[:hi]

    def generate_kwargs(
        self,
        n_prompt: int,
        max_new_tokens: int,
        *,
        do_sample: bool = False,
        temperature: float | None = None,
        top_p: float | None = None,
    ) -> dict[str, Any]:
        """Arguments for ``model.generate``; raises PromptTooLong (module docstring)."""
        if self.context is not None:
            if n_prompt >= self.context:
                raise PromptTooLong(
                    f"prompt and history are {n_prompt} tokens; the model's context is "
                    f"{self.context} tokens, which leaves no room for an answer: shorten the "
                    f"prompt or send fewer history rounds"
                )
            max_new_tokens = min(max_new_tokens, self.context - n_prompt)
        kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": do_sample}
        if do_sample:
            if temperature is not None:
                kwargs["temperature"] = temperature
            if top_p is not None:
                kwargs["top_p"] = top_p
        else:  # greedy: drop sampling knobs a saved generation_config may carry
            kwargs.update(temperature=None, top_p=None, top_k=None)
        return kwargs

    @torch.inference_mode()
    def run(self, job: GenerationJob) -> Answer:
        """Generate for one job (on the worker thread)."""
        ids = torch.tensor([job.input_ids], device=self.device)
        answer = self.answer_text(job)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            stopping_criteria=self._stopping(job, answer),
            streamer=AnswerStreamer(answer) if answer is not None else None,
            **job.kwargs,
        )
        new = out[0, ids.shape[1] :].tolist()
        stopped = bool(new) and new[-1] in self.eos_ids
        if answer is not None:
            text, stopped = answer.finish(), stopped or answer.stopped
        else:
            text = self.tokenizer.decode(new, skip_special_tokens=True)
        return Answer(
            text=text,
            prompt_tokens=ids.shape[1],
            completion_tokens=len(new),
            finish_reason="stop" if stopped else "length",
            token_ids=new,
        )

"""Request and response bodies of ``meshtrain serve`` (pydantic).

Types are strict where a silent conversion would hide a client bug: a ``prompt`` of
``5`` or a ``do_sample`` of ``"yes"`` is refused with 422 naming the field rather than
read as ``"5"`` or ``True``. Unknown fields are refused on ``POST /`` and
``POST /classify`` (a typo such as ``promt`` must not be ignored), but ignored on the
OpenAI endpoint, whose clients send many options this server does not use.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
)

Temperature = Annotated[float, Field(ge=0.0, le=100.0, strict=True)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, strict=True)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]


def _valid_unicode(v: str) -> str:
    """JSON may escape a lone UTF-16 surrogate (``"\\ud800"``); Python decodes it into a str
    no tokenizer can encode (a 500 found by tests/fuzz/test_fuzz_serve_http.py): a 422."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"contains a lone UTF-16 surrogate (\\u{ord(v[exc.start]):04x}) at character "
            f"{exc.start}, which is not text; \\ud800-\\udfff escapes must come as "
            "high-low pairs: send valid Unicode"
        ) from None
    return v


Text = Annotated[StrictStr, AfterValidator(_valid_unicode)]


class ChatRequest(BaseModel):
    """``POST /``: the seeds' ChatGLM ``api.py`` request."""

    model_config = ConfigDict(extra="forbid")

    prompt: Text = Field(min_length=1, description="the new user turn")
    history: list[list[Text]] = Field(
        default_factory=list, description="earlier turns as [prompt, response] pairs"
    )
    max_new_tokens: PositiveInt | None = None
    max_length: PositiveInt | None = Field(
        None, description="ChatGLM's cap on prompt + answer tokens (max_new_tokens wins)"
    )
    temperature: Temperature | None = None
    top_p: TopP | None = None
    do_sample: StrictBool | None = Field(
        None,
        description="sample instead of greedy; default: true when temperature or top_p is given",
    )

    @field_validator("history")
    @classmethod
    def _pairs(cls, v: list[list[str]]) -> list[list[str]]:
        for i, pair in enumerate(v):
            if len(pair) != 2:
                raise ValueError(
                    f"history[{i}] has {len(pair)} item(s); each round is a [prompt, response] pair"
                )
        return v


class ChatResponse(BaseModel):
    response: str
    history: list[list[str]]
    status: int = 200
    time: str  # "YYYY-MM-DD HH:MM:SS", local time, as the seeds' api.py
    dropped_rounds: int | None = Field(
        None,
        description="oldest history rounds left out so the conversation fits the context "
        "(present only when some were)",
    )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class ClassifyRequest(BaseModel):
    """``POST /classify``: one text, or a list of texts."""

    model_config = ConfigDict(extra="forbid")

    text: StrictStr | list[StrictStr]  # each checked by _valid_unicode below, named text[i]

    @field_validator("text")
    @classmethod
    def _not_empty(cls, v: str | list[str]) -> str | list[str]:
        texts = [v] if isinstance(v, str) else v
        if not texts:
            raise ValueError("text is an empty list; send at least one text")
        for i, t in enumerate(texts):
            where = "text" if isinstance(v, str) else f"text[{i}]"
            if not t.strip():
                raise ValueError(f"{where} is empty; send text to classify")
            try:
                _valid_unicode(t)
            except ValueError as exc:
                raise ValueError(f"{where} {exc}") from None
        return v


class Prediction(BaseModel):
    label: str
    score: float
    truncated: bool = Field(description="the text was cut to the model's context")


class OpenAIMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: Text


class OpenAIChatRequest(BaseModel):
    """``POST /v1/chat/completions``: the subset of OpenAI's request this server honours."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    messages: list[OpenAIMessage] = Field(min_length=1)
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    stop: StrictStr | list[StrictStr] | None = Field(
        None, description="up to 4 strings; the answer ends before the first that appears"
    )

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        from meshtrain.serve.stops import MAX_STOPS

        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"{len(stops)} stop strings; at most {MAX_STOPS} (as OpenAI)")
        for i, s in enumerate(stops):
            if not s:
                where = "stop" if isinstance(v, str) else f"stop[{i}]"
                raise ValueError(f"{where} is an empty string; a stop string needs text")
        return v

    @field_validator("messages")
    @classmethod
    def _ends_with_user(cls, v: list[OpenAIMessage]) -> list[OpenAIMessage]:
        if v[-1].role != "user":
            raise ValueError("the last message must have role 'user'")
        return v

    def conversation(self) -> tuple[str, list[tuple[str, str]], str | None]:
        """(prompt, [prompt, response] pairs, system text) from the messages.

        Consecutive user turns are joined with a blank line; an assistant turn closes the
        round. System messages are kept apart (the chat template places them)."""
        system = "\n\n".join(m.content for m in self.messages if m.role == "system") or None
        history: list[tuple[str, str]] = []
        pending: list[str] = []
        for m in self.messages:
            if m.role == "user":
                pending.append(m.content)
            elif m.role == "assistant":
                history.append(("\n\n".join(pending), m.content))
                pending = []
        return "\n\n".join(pending), history, system


def openai_completion(
    rid: str, created: int, model: str, text: str, finish: str, usage: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
            }
        ],
        "usage": usage,
    }


def openai_chunk(
    rid: str, created: int, model: str, delta: dict[str, str], finish: str | None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }

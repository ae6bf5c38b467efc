"""The FastAPI application of ``meshtrain serve``: routes, limits and error answers.

Routes (``docs/serve.md`` has curl examples):

* ``GET /health`` -- liveness and queue depth; ``GET /`` -- what is served.
* ``POST /classify`` -- ``{"text": str | [str]}`` -> ``{"label", "score", "truncated"}``
  (or a list), dynamically batched (``batching.py``).
* ``POST /`` -- the seeds' chat shape ``{"prompt", "history"}`` ->
  ``{"response", "history", "status", "time"}``.
* ``POST /v1/chat/completions`` -- OpenAI's chat completion, ``"stream": true`` as
  server-sent events ending with ``data: [DONE]``, ``"stop"`` strings (``stops.py``).
* ``GET /chat`` -- a chat page (static HTML and JavaScript) streaming from the OpenAI route.
* ``GET /metrics`` -- Prometheus text format (``metrics.py``).

Chat requests are continuously batched (``continuous.py``): up to ``chat_batch_size``
sequences decode together, joining and leaving at every step; ``chat_batch_size=1`` runs
one ``model.generate`` at a time (``generation.py``); when ``meshtrain serve`` forked the
HTTP side off (``split_process.py``), ``app.state.model_process`` holds the pipes and
the worker is a ``RemoteWorker`` talking to the model's process. A conversation longer
than the context loses its oldest history rounds (``context_overflow="drop-oldest"``,
reported as ``dropped_rounds`` and the ``X-Dropped-Rounds`` header) or gets 422 (``"error"``).

Errors are answers, never crashes: every bad input gets a 4xx whose JSON body names the
field (``http_errors.py``) -- 400 invalid JSON, 415 JSON without ``Content-Type:
application/json``, 413 a body over ``max_body_bytes``, 422 a missing field, a wrong type,
a history that is not pairs, an empty text, a prompt longer than the context; a route
this task does not serve is 404. A full queue is 503 with ``Retry-After``, a request over
``timeout_s`` is 504 (and its generation is stopped). No global state: everything
lives on the app built by :func:`build_app`, so tests run several servers in one process.
"""

import asyncio
import functools
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import asdict
from datetime import datetime
from typing import Any

from meshtrain.serve.batching import DynamicBatcher, QueueFull
from meshtrain.serve.http_errors import ApiError, BodyLimit, error_body, validation_answer
from meshtrain.serve.model_loading import ServedModel
from meshtrain.serve.settings import ServeSettings

log = logging.getLogger("meshtrain.serve")


def build_app(served: ServedModel, settings: ServeSettings | None = None) -> Any:
    """A FastAPI app serving ``served`` with ``settings`` (module docstring)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from meshtrain.serve import schemas
    from meshtrain.serve.metrics import MetricsMiddleware, ServeMetrics

    settings = settings or ServeSettings()
    classifier = chat = batcher = worker = None
    batching = "off (chat_batch_size=1)"
    metrics = ServeMetrics(
        queue_depth=lambda: {
            "chat": worker.waiting if worker is not None else 0,
            "classify": batcher.waiting if batcher is not None else 0,
        },
        running=lambda: getattr(worker, "running", 0) if worker is not None else 0,
        tokens=lambda: worker.tokens if worker is not None else 0,
    )
    if served.task == "text-classification":
        from meshtrain.serve.classify import Classifier

        classifier = Classifier(served)
        batcher = DynamicBatcher(
            classifier,
            max_batch_size=settings.max_batch_size,
            max_wait_ms=settings.max_wait_ms,
            max_queue=settings.max_batch_queue,
            on_batch=lambda n: metrics.step("classify", n),
        )
    else:
        from meshtrain.serve.chat import Chat
        from meshtrain.serve.generation import GenerationWorker

        chat = Chat(served, chat_format=settings.chat_format)
        if settings.chat_batch_size > 1:
            from meshtrain.serve.paged_model import blocker

            why = blocker(served.model, served.context_length)
            batching = f"continuous, up to {settings.chat_batch_size} sequences"
            if why is not None:
                batching = f"off ({why})"
                log.warning("chat requests run one at a time: %s", why)

    def local_worker(on_step, max_queue: int = settings.max_queue, inbox=None) -> Any:
        """The chat worker of this process: the continuous batcher, or one at a time
        (``inbox``: see ``ContinuousBatcher``; the one-at-a-time worker takes none)."""
        if batching.startswith("continuous"):
            from meshtrain.serve.continuous import ContinuousBatcher

            return ContinuousBatcher(
                chat,
                max_batch=settings.chat_batch_size,
                max_queue=max_queue,
                prefill_chunk=settings.prefill_chunk,
                kv_blocks=settings.kv_blocks,
                on_step=on_step,
                inbox=inbox,
            )
        return GenerationWorker(chat.run, max_queue=max_queue, on_done=lambda: on_step(1))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal worker
        if batcher is not None:
            await batcher.start()
        if chat is not None:
            on_step = functools.partial(metrics.step, "chat")
            remote = getattr(app.state, "model_process", None)  # split_process.serve_split
            if remote is not None:
                from meshtrain.serve.split_process import RemoteWorker

                worker = RemoteWorker(*remote, max_queue=settings.max_queue, on_step=on_step)
            else:
                worker = local_worker(on_step)
        yield
        if batcher is not None:
            await batcher.stop()
        if worker is not None:
            worker.close()

    app = FastAPI(title="meshtrain serve", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    # outermost, so 413s and every error answer are counted too
    app.add_middleware(
        MetricsMiddleware, metrics=metrics, routes=lambda: {r.path for r in app.routes}
    )
    app.state.served, app.state.settings, app.state.metrics = served, settings, metrics
    app.state.chat_worker = local_worker if chat is not None else None

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        status, body = validation_answer(exc)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        body = error_body(exc.status, exc.field, exc.message)
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = error_body(exc.status_code, None, str(exc.detail))
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        # not the client's fault: log the traceback, answer JSON like every other error
        log.exception("%s %s failed", request.method, request.url.path)
        body = error_body(500, None, f"internal error ({type(exc).__name__}: {exc})")
        return JSONResponse(body, status_code=500)

    def _needs(task: str, route: str) -> None:
        if served.task != task:
            other = "POST /classify" if served.task == "text-classification" else "POST /"
            raise ApiError(
                404, None, f"{route} serves {task}; this server serves {served.task} ({other})"
            )

    def _busy(exc: QueueFull) -> ApiError:
        headers = {"Retry-After": str(settings.retry_after_s)}
        return ApiError(503, None, f"server busy: {exc}; retry later", headers)

    def _late() -> ApiError:
        return ApiError(504, None, f"no answer within {settings.timeout_s:g} s; retry later")

    @app.get("/health")
    async def health() -> dict:
        waiting = worker.waiting if worker is not None else 0
        return {"status": "ok", "task": served.task, "waiting": waiting}

    @app.get("/")
    async def info() -> dict:
        out = {
            "model": settings.model_name,
            "task": served.task,
            "source": served.source,
            "architecture": type(served.model).__name__,
            "dtype": str(served.dtype).removeprefix("torch."),
            "context_length": served.context_length,
            **served.info,
            "settings": asdict(settings),
        }
        if classifier is not None:
            out["labels"] = classifier.id2label
            out["batches"], out["batched_texts"] = batcher.batches, batcher.items
        if chat is not None:
            out["chat_format"] = chat.chat_format
            out["chat_batching"] = batching
            out["answered"] = worker.done if worker is not None else 0
            out["generated_tokens"] = worker.tokens if worker is not None else 0
        return out

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/chat", response_class=HTMLResponse)
    async def chat_page() -> HTMLResponse:
        _needs("chat", "GET /chat")
        from meshtrain.serve.chat_page import page

        return HTMLResponse(page(settings.model_name, settings.max_new_tokens))

    @app.post("/classify", response_model=schemas.Prediction | list[schemas.Prediction])
    async def classify(req: schemas.ClassifyRequest) -> Any:
        _needs("text-classification", "POST /classify")
        texts = [req.text] if isinstance(req.text, str) else req.text
        if len(texts) > settings.max_texts:
            raise ApiError(422, "text", f"{len(texts)} texts; at most {settings.max_texts}")
        try:
            preds = await asyncio.wait_for(batcher.submit(texts), settings.timeout_s)
        except QueueFull as exc:
            raise _busy(exc) from None
        except asyncio.TimeoutError:
            raise _late() from None
        return preds[0] if isinstance(req.text, str) else preds

    def _prepare(
        prompt, history, system, max_new, max_length, do_sample, temperature, top_p, max_field
    ):
        """(ids, generate kwargs, history rounds dropped to fit the context)."""
        if max_new is not None and max_new > settings.max_new_tokens:
            raise ApiError(
                422,
                max_field,
                f"{max_new} is over this server's limit "
                f"{settings.max_new_tokens} (meshtrain serve --max-new-tokens)",
            )
        dropped = 0
        if settings.context_overflow == "drop-oldest" and chat.context is not None:
            reserve = min(max_new or settings.max_new_tokens, chat.context // 2)
            ids, dropped = chat.fit(prompt, history, system, reserve)
        else:
            ids = chat.prompt_ids(prompt, history, system)
        if max_new is None and max_length is not None:
            max_new = max_length - len(ids)
            if max_new < 1:
                raise ApiError(
                    422,
                    "max_length",
                    f"{max_length} leaves no room after the "
                    f"{len(ids)} tokens of prompt and history",
                )
            max_new = min(max_new, settings.max_new_tokens)
        if do_sample is None:
            do_sample = temperature is not None or top_p is not None
        if temperature == 0:
            do_sample = False  # OpenAI's convention: temperature 0 is greedy
        from meshtrain.serve.chat import PromptTooLong

        try:
            kwargs = chat.generate_kwargs(
                len(ids),
                max_new or settings.max_new_tokens,
                do_sample=do_sample,
                temperature=temperature,
                top_p=top_p,
            )
        except PromptTooLong as exc:
            raise ApiError(422, "prompt", str(exc)) from None
        return ids, kwargs, dropped

    def _dropped_header(dropped: int) -> dict[str, str]:
        return {"X-Dropped-Rounds": str(dropped)}

    def _submit(ids: list[int], kwargs: dict, stream: bool = False, stop=()):
        try:
            return worker.submit(ids, kwargs, stream=stream, stop=stop)
        except QueueFull as exc:
            raise _busy(exc) from None

    async def _answer(job) -> Any:
        try:
            return await asyncio.wait_for(job.future, settings.timeout_s)
        except asyncio.TimeoutError:
            job.cancelled.set()
            raise _late() from None

    @app.post("/", response_model=schemas.ChatResponse, response_model_exclude_none=True)
    async def chat_seed(req: schemas.ChatRequest, response: Response) -> Any:
        _needs("chat", "POST /")
        history = [(q, a) for q, a in req.history]
        ids, kwargs, dropped = _prepare(
            req.prompt,
            history,
            None,
            req.max_new_tokens,
            req.max_length,
            req.do_sample,
            req.temperature,
            req.top_p,
            "max_new_tokens",
        )
        answer = await _answer(_submit(ids, kwargs))
        response.headers.update(_dropped_header(dropped))
        return {
            "response": answer.text,
            "history": [list(p) for p in history] + [[req.prompt, answer.text]],
            "status": 200,
            "time": datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
            "dropped_rounds": dropped or None,  # present only when rounds were dropped
        }

    @app.post("/v1/chat/completions")
    async def chat_openai(req: schemas.OpenAIChatRequest) -> Any:
        _needs("chat", "POST /v1/chat/completions")
        prompt, history, system = req.conversation()
        ids, kwargs, dropped = _prepare(
            prompt,
            history,
            system,
            req.max_completion_tokens or req.max_tokens,
            None,
            None,
            req.temperature,
            req.top_p,
            "max_completion_tokens" if req.max_completion_tokens else "max_tokens",
        )
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        name = settings.model_name
        from meshtrain.serve.stops import normalize

        job = _submit(ids, kwargs, stream=req.stream, stop=normalize(req.stop))
        if not req.stream:
            a = await _answer(job)
            usage = {
                "prompt_tokens": a.prompt_tokens,
                "completion_tokens": a.completion_tokens,
                "total_tokens": a.prompt_tokens + a.completion_tokens,
            }
            body = schemas.openai_completion(rid, created, name, a.text, a.finish_reason, usage)
            if dropped:
                body["dropped_rounds"] = dropped
            return JSONResponse(body, headers=_dropped_header(dropped))

        def event(payload: dict | str) -> str:
            data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
            return f"data: {data}\n\n"

        async def events():
            deadline = time.monotonic() + settings.timeout_s
            try:
                yield event(schemas.openai_chunk(rid, created, name, {"role": "assistant"}, None))
                pieces = job.pieces()
                while True:
                    left = deadline - time.monotonic()
                    try:
                        piece = await asyncio.wait_for(pieces.__anext__(), max(left, 0.001))
                    except StopAsyncIteration:
                        break
                    except asyncio.TimeoutError:
                        job.cancelled.set()
                        late = f"no answer within {settings.timeout_s:g} s"
                        yield event({"error": error_body(504, None, late)})
                        return
                    yield event(schemas.openai_chunk(rid, created, name, {"content": piece}, None))
                answer = await job.future
                last = schemas.openai_chunk(rid, created, name, {}, answer.finish_reason)
                if dropped:
                    last["dropped_rounds"] = dropped
                yield event(last)
                if req.stream_options is not None and req.stream_options.include_usage:
                    usage = {
                        "prompt_tokens": answer.prompt_tokens,
                        "completion_tokens": answer.completion_tokens,
                        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
                    }
                    yield event(
                        {
                            **schemas.openai_chunk(rid, created, name, {}, None),
                            "choices": [],
                            "usage": usage,
                        }
                    )
                yield event("[DONE]")
            finally:  # the client went away or the stream ended: stop generating
                job.cancelled.set()

        return StreamingResponse(
            events(), media_type="text/event-stream", headers=_dropped_header(dropped)
        )

    return app

"""HTTP error answers of ``meshtrain serve``: one JSON shape for every 4xx/5xx, the
413 body limit, and the mapping of request validation errors to 400/415/422.

Every error body is ``{"error": "<field>: <what is wrong>", "field", "status", "detail"}``
so a client (or a person reading curl output) sees which field to fix.
"""

import json
from typing import Any


class ApiError(Exception):
    """A 4xx/5xx answer with the field it concerns."""

    def __init__(
        self, status: int, field: str | None, message: str, headers: dict | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.field, self.message, self.headers = status, field, message, headers


def error_body(status: int, field: str | None, message: str, detail: Any = None) -> dict:
    text = f"{field}: {message}" if field else message
    return {"error": text, "field": field, "status": status, "detail": detail or []}


class BodyLimit:
    """ASGI middleware: 413 for a body over ``max_bytes``, by its Content-Length or, for a
    chunked body, as soon as the bytes received pass the limit (nothing more is read)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def _reject(self, send: Any, size: str) -> None:
        from starlette.responses import JSONResponse

        msg = f"the request body is {size} bytes; this server accepts at most {self.max_bytes}"
        resp = JSONResponse(error_body(413, "body", msg), status_code=413)
        await resp({"type": "http"}, None, send)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._reject(send, length.decode())
        seen, started, rejected = 0, False, False

        async def limited_receive() -> Any:
            nonlocal seen, rejected
            msg = await receive()
            if msg["type"] == "http.request" and not rejected:
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    # answer now and tell the app the client left: it stops reading, and
                    # whatever it would send instead is dropped by tracked_send
                    rejected = True
                    if not started:
                        await self._reject(send, f"more than {self.max_bytes}")
                    return {"type": "http.disconnect"}
            return msg

        async def tracked_send(msg: Any) -> None:
            nonlocal started
            if rejected:
                return
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        await self.app(scope, limited_receive, tracked_send)


def validation_answer(exc: Any) -> tuple[int, dict]:
    """400 for a body that is not JSON, 415 for JSON sent without its Content-Type, else
    422; the message names the first bad field."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field = ".".join(loc) or "body"
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx", {}).get("error", "")
        return 400, error_body(400, "body", f"is not valid JSON ({ctx})")
    raw = first.get("input")
    if loc == [] and isinstance(raw, bytes | str):  # FastAPI parses JSON only if declared
        try:
            json.loads(raw)
        except ValueError as exc:
            return 400, error_body(400, "body", f"is not valid JSON ({exc})")
        return 415, error_body(
            415,
            "body",
            "is JSON but the Content-Type header is not; send -H 'Content-Type: application/json'",
        )
    msg = first.get("msg", "invalid").removeprefix("Value error, ")
    if first.get("type") == "missing":
        msg = "is required"
    # pydantic's detail may hold the raw input and exception objects: keep what is JSON
    detail = [{k: e[k] for k in ("loc", "msg", "type") if k in e} for e in errors]
    return 422, error_body(422, field, msg, detail)

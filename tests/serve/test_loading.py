"""MODEL resolution and start-up failures: a wrong MODEL fails with one clear line before
the port is bound; the command serves for real in a subprocess."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from meshtrain import cli
from meshtrain.errors import ServeError
from meshtrain.serve.model_loading import load, resolve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_resolve_kinds_and_errors(tmp_path, classifier_dir):
    with pytest.raises(ServeError, match="does not exist"):
        resolve(tmp_path / "nope")
    (tmp_path / "f.bin").write_bytes(b"x")
    with pytest.raises(ServeError, match="is a file"):
        resolve(tmp_path / "f.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ServeError, match="neither a save_pretrained folder"):
        resolve(tmp_path / "empty")
    # a Trainer output_dir: the numerically newest checkpoint-N, not the lexically last
    out = tmp_path / "trainer_out"
    for n in (2, 10):
        shutil.copytree(classifier_dir, out / f"checkpoint-{n}")
    r = resolve(out)
    assert r.kind == "pretrained" and r.path == out / "checkpoint-10" and "newest of 2" in r.note
    served = load(out)
    assert served.task == "text-classification" and "checkpoint-10" in served.source


def test_load_refuses_what_does_not_fit(tmp_path, classifier_dir, chat_dir):
    with pytest.raises(ServeError, match="cannot serve --task chat"):
        load(classifier_dir, task="chat")
    with pytest.raises(ServeError, match="cannot serve --task text-classification"):
        load(chat_dir, task="text-classification")
    bare = tmp_path / "bare" / "model"
    bare.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(classifier_dir / f, bare / f)
    with pytest.raises(ServeError, match="no tokenizer found.*--tokenizer"):
        load(bare)
    assert load(bare, tokenizer=str(classifier_dir)).task == "text-classification"
    with pytest.raises(ServeError, match="--tokenizer .* does not exist"):
        load(bare, tokenizer=str(tmp_path / "nope"))
    with pytest.raises(ServeError, match="--dtype"):
        load(classifier_dir, dtype="int8")
    import torch

    from meshtrain.checkpoint import Piece, save_shards

    meta = {"tensors": {"w": {"shape": [3], "dtype": "float32", "kind": "param"}}}
    piece = Piece("w", "param", "m", 0, 0, 3)
    save_shards(
        tmp_path / "plain",
        "t",
        group=None,
        tensors={"m": torch.zeros(3)},
        pieces=[piece],
        meta=meta,
    )
    with pytest.raises(ServeError, match="not saved from a transformers model"):
        load(tmp_path / "plain")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "latest").write_text("global_step9\n")
    with pytest.raises(ServeError, match="broken"):
        load(tmp_path / "broken")


def test_cli_fails_before_binding_the_port(tmp_path, capsys):
    port = _free_port()
    rc = cli.main(["serve", str(tmp_path / "missing"), "--port", str(port)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("meshtrain serve: error: MODEL") and "does not exist" in err
    with socket.socket() as s:  # nobody took the port
        s.bind(("127.0.0.1", port))


def _serve_on_a_free_port(model_dir, *flags: str) -> tuple[subprocess.Popen, int]:
    """``meshtrain serve MODEL_DIR *FLAGS`` in a subprocess, up and answering /health.

    The port is free when chosen but bound later by the subprocess; if another process
    took it meanwhile, the server exits with EADDRINUSE and a fresh port is tried."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for _ in range(3):
        port = _free_port()
        cmd = [sys.executable, "-m", "meshtrain", "serve", str(model_dir)]
        proc = subprocess.Popen(
            [*cmd, "--port", str(port), *flags],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 300  # bounds a hang; a loaded machine is slow
        while proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    return proc, port
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"server did not come up:\n{proc.communicate()[0]}")
            time.sleep(0.2)
        out = proc.stdout.read().decode()
        if "address already in use" not in out.lower():
            raise AssertionError(out)
    raise AssertionError("three free ports were taken before the server bound them")


def test_cli_serves_in_a_subprocess(classifier_dir):
    proc, port = _serve_on_a_free_port(classifier_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        # httpx's default 5 s timeout is too short for a model on a loaded machine
        r = httpx.post(f"{url}/classify", json={"text": "我觉得不错!"}, timeout=60)
        assert r.status_code == 200 and r.json()["label"] in ("差评!", "好评!")
        info = httpx.get(f"{url}/", timeout=60).json()
        assert info["model"] == Path(classifier_dir).name and info["task"] == "text-classification"
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0].decode()
    assert "meshtrain serve: text-classification from save_pretrained folder" in out

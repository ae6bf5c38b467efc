"""Fixtures: tiny model folders (built once per session) and real uvicorn servers on
127.0.0.1, each on a free port, in a background thread of the test process."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from tests.serve import models


@pytest.fixture(scope="session")
def classifier_dir(tmp_path_factory):
    return models.save_classifier(tmp_path_factory.mktemp("classifier"))


@pytest.fixture(scope="session")
def chat_dir(tmp_path_factory):
    return models.save_chat(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="session")
def chat_template_dir(tmp_path_factory):
    return models.save_chat(tmp_path_factory.mktemp("chat_tpl"), chat_template=models.CHAT_TEMPLATE)


@contextlib.contextmanager
def live_server(served, **settings):
    """Serve ``served`` with uvicorn on a free 127.0.0.1 port; yields the base URL."""
    import uvicorn

    from meshtrain.serve.app import ServeSettings, build_app

    app = build_app(served, ServeSettings(**settings))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="session")
def served_classifier(classifier_dir):
    from meshtrain.serve.model_loading import load

    return load(classifier_dir)


@pytest.fixture(scope="session")
def served_chat(chat_dir):
    from meshtrain.serve.model_loading import load

    return load(chat_dir)

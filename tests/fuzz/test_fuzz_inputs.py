"""Fuzzing harness (hypothesis) over what users hand meshtrain: config files, data files,
checkpoints and serve requests.

The contract, for every generated input: a correct result or the project's own named error
(``MeshtrainError`` in one line naming the file; pydantic's ValidationError, which serve
turns into a 422 naming the field) -- never another exception (a traceback), never a hang,
never a silently wrong result. Inputs are malformed, truncated, mutated (byte flips,
insertions, deletions, duplicated keys) and boundary values derived from valid files.

Budget: ``MESHTRAIN_FUZZ_EXAMPLES`` examples per target (default 25, derandomized so CI
sees the same inputs every run); set it higher for a long run on demand, e.g.

    MESHTRAIN_FUZZ_EXAMPLES=2000 pytest tests/fuzz -q -p no:cacheprovider \
        --hypothesis-show-statistics

docs/reliability.md records the inputs tried by such runs and what they found.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshtrain.errors import MeshtrainError

EXAMPLES = int(os.environ.get("MESHTRAIN_FUZZ_EXAMPLES", "25"))
LONG = "MESHTRAIN_FUZZ_EXAMPLES" in os.environ
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # the machine is shared; hangs are caught by the alarm below instead
    derandomize=not LONG,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
HANG_S = 20


@contextmanager
def no_hang(what: str):
    """Fail (not wait forever) when one input takes longer than ``HANG_S``."""

    def _alarm(*_):
        raise AssertionError(f"{what}: no answer within {HANG_S}s (a hang)")

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(HANG_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _named(exc: MeshtrainError, path: Path) -> None:
    text = str(exc)
    assert str(path) in text or path.name in text, f"error does not name {path}: {text}"


# ---- mutations of valid bytes ------------------------------------------------------------
@st.composite
def mutated(draw, seeds: list[bytes]) -> bytes:
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "dup_line"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= draw(st.integers(1, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[pos : pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[pos:]
        elif op == "dup_line":
            lines = bytes(data).split(b"\n")
            i = draw(st.integers(0, len(lines) - 1))
            lines.insert(i, lines[i])
            data = bytearray(b"\n".join(lines))
    return bytes(data)


CONFIG_SEEDS = [
    json.dumps(
        {
            "train_batch_size": 8,
            "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 2},
            "bf16": {"enabled": True},
        },
        indent=2,
    ).encode(),
    b"train_batch_size: 8\nzero_optimization:\n  stage: 3\n  offload_param:\n    device: cpu\n",
    b"{}",
]


@FUZZ
@given(data=st.one_of(mutated(CONFIG_SEEDS), st.binary(max_size=200)), yaml_=st.booleans())
def test_config_loader(tmp_path, data, yaml_):
    from meshtrain.config.loading import load_config

    path = tmp_path / ("c.yaml" if yaml_ else "c.json")
    path.write_bytes(data)
    with no_hang("load_config"):
        try:
            config = load_config(path, world_size=2)
        except MeshtrainError as exc:
            _named(exc, path)
            return
    assert config.train_batch_size >= 1  # a result: a validated, resolved Config


JSONL_SEED = b"".join(
    json.dumps({"text": t, "label": i % 3}).encode() + b"\n"
    for i, t in enumerate(["hello", "caf\u00e9 \u00fc", "\u4e2d\u6587", "a\tb", "x" * 40])
)
CSV_SEED = b'text,label\nhello,1\n"a, quoted\nline",2\ncaf\xc3\xa9,0\n'


@FUZZ
@given(data=st.one_of(mutated([JSONL_SEED]), st.binary(max_size=300)))
def test_jsonl_reader_rows(data):
    from meshtrain.data.readers import parse_lines

    with no_hang("parse_lines"):
        rows = parse_lines(data, "jsonl", "text", "label", stop_at_bad=False)
    n = len(data.split(b"\n")) - (1 if data.endswith(b"\n") or not data else 0)
    assert rows.lines == n
    assert len(rows.texts) + rows.empty + len(rows.bad) == n
    assert all(isinstance(t, str) and t.strip() for t in rows.texts)
    assert all(isinstance(x, int) for x in rows.labels) and len(rows.labels) == len(rows.texts)
    assert all(1 <= line <= n and isinstance(why, str) for line, why in rows.bad)


@FUZZ
@given(
    data=st.one_of(mutated([CSV_SEED, JSONL_SEED]), st.binary(max_size=300)),
    fmt=st.sampled_from(["csv", "json"]),
)
def test_data_files_through_prepare(tmp_path, data, fmt):
    from meshtrain.data import prepare
    from meshtrain.data.store import TokenStore

    path = tmp_path / f"in.{'csv' if fmt == 'csv' else 'json'}"
    path.write_bytes(data)
    out = tmp_path / "s"
    shutil.rmtree(out, ignore_errors=True)
    with no_hang("prepare"):
        try:
            result = prepare(path, "byte", out, label_field="label", workers=1, skip_bad_rows=True)
        except MeshtrainError as exc:
            _named(exc, path)
            return
    store = TokenStore(out)  # what was written loads and matches the summary
    assert len(store) == result.docs and store.num_tokens == result.tokens


# ---- checkpoint reader -----------------------------------------------------------------
@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    from meshtrain.checkpoint import save_shards
    from tests.checkpoint.common import full_state, meta, shard

    root = tmp_path_factory.mktemp("fuzz-ckpt")
    tensors, pieces = shard(full_state(3), 0, 1)
    save_shards(root / "ck", "t", group=None, tensors=tensors, pieces=pieces, meta=meta())
    return root / "ck"


def _read_all(path: Path) -> dict:
    from meshtrain.checkpoint import CheckpointReader

    with CheckpointReader(path, "t") as r:
        out = {(n, s): r.read(n, s) for s in r.states() for n in r.names(s)}
        out["rng"] = r.rank_tensor(0, "rng.torch")
        out["meta"] = json.dumps(r.meta, sort_keys=True)
        out["state"] = json.dumps(r.rank_state(0), sort_keys=True)
    return out


@FUZZ
@given(
    which=st.sampled_from(["manifest.json", "rank00000.safetensors"]),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["flip", "truncate", "insert", "delete"]),
            st.floats(0, 1),
            st.integers(1, 255),
        ),
        min_size=1,
        max_size=3,
    ),
)
def test_checkpoint_reader(pristine, tmp_path, which, ops):
    case = tmp_path / "ck"
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(pristine, case)
    target = case / "t" / which
    data = bytearray(target.read_bytes())
    for op, where, value in ops:
        pos = min(len(data) - 1, int(where * len(data))) if data else 0
        if op == "flip" and data:
            data[pos] ^= value
        elif op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = bytes([value])
        elif op == "delete" and data:
            del data[pos]
    changed = bytes(data) != target.read_bytes()
    target.write_bytes(bytes(data))
    with no_hang("CheckpointReader"):
        try:
            got = _read_all(case)
        except MeshtrainError as exc:
            _named(exc, target)
            return
    want = _read_all(pristine)
    assert not changed, f"{which} was damaged ({ops}) and loaded without an error"
    for k, v in want.items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v


# ---- serve request parsing ---------------------------------------------------------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=12,
)
CHAT_KEYS = [
    "prompt",
    "history",
    "max_new_tokens",
    "max_length",
    "temperature",
    "top_p",
    "do_sample",
]


@st.composite
def request_bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["keys", "any", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=120))
    if kind == "any":
        return json.dumps(draw(JSON_VALUES)).encode()
    keys = draw(
        st.lists(st.sampled_from([*CHAT_KEYS, "text", "messages", "stream", "promt"]), max_size=6)
    )
    return json.dumps({k: draw(JSON_VALUES) for k in keys}).encode()


@FUZZ
@given(body=request_bodies())
def test_serve_request_parsing(body):
    from pydantic import ValidationError

    from meshtrain.serve import schemas

    for model in (schemas.ChatRequest, schemas.ClassifyRequest, schemas.OpenAIChatRequest):
        try:
            req = model.model_validate_json(body)
        except ValidationError:
            continue  # serve answers 422 naming the field (tests/serve/test_bad_input.py)
        if model is schemas.ChatRequest:
            assert isinstance(req.prompt, str) and req.prompt
            assert all(len(p) == 2 and all(isinstance(x, str) for x in p) for p in req.history)
            assert req.max_new_tokens is None or req.max_new_tokens >= 1

"""The catalogue of bad inputs (issue 18): every row is one mistake a user makes.

Each case builds its bad input in ``tmp_path``, runs the public entry point, and asserts
the exact exception type and that the message names the field, file or line *and* the
fix (every pattern below holds both). Cases marked "issue 18" were weak or silent before.
Single-process and fast; the launcher cases start real ``meshtrain launch`` processes
that fail before any worker starts.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from meshtrain.config import load_config
from meshtrain.errors import CheckpointError, ConfigError, DataError, ServeError, TrainingError

REPO = Path(__file__).resolve().parents[1]


def _cfg(config: dict, world_size: int | None = None) -> Callable[[Path], object]:
    return lambda tmp: load_config(config, world_size=world_size)


def _cfg_file(name: str, text: str) -> Callable[[Path], object]:
    def run(tmp: Path) -> object:
        path = tmp / name
        path.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
        return load_config(path)

    return run


def _prepare(lines: list[bytes] | bytes, **kw) -> Callable[[Path], object]:
    def run(tmp: Path) -> object:
        from meshtrain.data import prepare

        path = tmp / "rows.jsonl"
        path.write_bytes(lines if isinstance(lines, bytes) else b"\n".join(lines) + b"\n")
        return prepare(path, "byte", tmp / "store", **kw)

    return run


def _rows(n: int) -> list[bytes]:
    return [json.dumps({"text": f"row {i}"}).encode() for i in range(n)]


def _truncated_store(tmp: Path) -> object:
    from meshtrain.data import prepare
    from meshtrain.data.store import TokenStore

    (tmp / "rows.jsonl").write_bytes(b"\n".join(_rows(20)) + b"\n")
    prepare(tmp / "rows.jsonl", "byte", tmp / "store")
    tokens = tmp / "store" / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:-7])
    store = TokenStore(tmp / "store")
    return store.doc(len(store) - 1)


def _checkpoint(tmp: Path) -> Path:
    from meshtrain.checkpoint import save_shards
    from tests.checkpoint.common import full_state, meta, shard

    tensors, pieces = shard(full_state(0), 0, 1)
    save_shards(tmp / "ckpt", "t1", group=None, tensors=tensors, pieces=pieces, meta=meta())
    return tmp / "ckpt"


def _ckpt_damaged(damage: Callable[[Path], None], action: str = "open"):
    def run(tmp: Path) -> object:
        from meshtrain.checkpoint import CheckpointReader

        save_dir = _checkpoint(tmp)
        damage(save_dir)
        reader = CheckpointReader(save_dir)
        if action == "read":  # what a load reads: every tensor and the rank's RNG state
            return [reader.read(n) for n in reader.names()], reader.rank_tensor(0, "rng.torch")
        if action == "model":
            from tests.checkpoint.common import SHAPES

            return reader.check_model({**SHAPES, "layer.extra": (4,)})
        return reader

    return run


def _flip(save_dir: Path) -> None:
    f = save_dir / "t1" / "rank00000.safetensors"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(bytes(data))


def _hostfile(text: str) -> Callable[[Path], object]:
    def run(tmp: Path) -> object:
        from meshtrain.launch.hostfile import parse_hostfile

        (tmp / "hosts").write_text(text)
        return parse_hostfile(tmp / "hosts")

    return run


def _output_dir(make: Callable[[Path], Path]) -> Callable[[Path], object]:
    def run(tmp: Path) -> object:
        from meshtrain.jobs.train.run_lock import check_output_dir

        return check_output_dir(make(tmp))

    return run


def _held_lock(tmp: Path) -> object:
    from meshtrain.jobs.train.run_lock import RunLock

    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert holder.stdout.readline().strip() == b"locked"
        return RunLock(tmp).acquire()
    finally:
        holder.kill()
        holder.wait()


HOLD_LOCK = """
import sys, time
from meshtrain.jobs.train.run_lock import RunLock
lock = RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(60)
"""


def _scaler(precision: str) -> Callable[[Path], object]:
    def run(tmp: Path) -> object:
        from meshtrain.precision import LossScaler

        scaler = LossScaler.disabled(precision)
        scaler.update(False)
        for _ in range(10):
            scaler.update(True)  # a NaN loss: the grad norm is not finite

    return run


def _tokenizer(tmp: Path) -> object:
    from meshtrain.data.tokenizer import load_tokenizer

    os.environ["HF_HUB_OFFLINE"] = "1"  # the machine's state here; restored by monkeypatch
    return load_tokenizer("no-such-org/no-such-tokenizer")


def _args(**kwargs) -> Callable[[Path], object]:
    def run(tmp: Path) -> object:
        from meshtrain import TrainingArguments

        return TrainingArguments(output_dir=str(tmp / "out"), **kwargs)

    return run


def _accelerator(**kwargs) -> Callable[[Path], object]:
    # each of these is refused before Accelerator joins a process group
    def run(tmp: Path) -> object:
        from meshtrain import Accelerator

        return Accelerator(**kwargs)

    return run


@functools.cache
def _classifier() -> Path:
    """A tiny BERT classifier saved with save_pretrained (once per session)."""
    from tests.serve import models

    folder = Path(tempfile.mkdtemp(prefix="meshtrain-bad-serve-"))
    atexit.register(shutil.rmtree, folder, True)
    return models.save_classifier(folder / "model")


def _served(damage: Callable[[Path], object]) -> Callable[[Path], object]:
    def run(tmp: Path) -> object:
        from meshtrain.serve.model_loading import load

        folder = tmp / "model"
        shutil.copytree(_classifier(), folder)
        damage(folder)
        return load(folder)

    return run


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


CASES: list[tuple[str, Callable[[Path], object], type[Exception], str]] = [
    # ---- configs: misspelled keys at every level, types, batch triples, precisions, layouts
    ("config top-level typo", _cfg({"train_batch_sze": 8}), ConfigError,
     r"^train_batch_sze: unknown key; did you mean train_batch_size\?"),
    ("config nested typo", _cfg({"zero_optimization": {"stag": 2}}), ConfigError,
     r"^zero_optimization\.stag: unknown key; did you mean stage\?"),
    ("config deep typo", _cfg({"optimizer": {"type": "AdamW", "params": {"lrr": 1e-3}}}),
     ConfigError, r"^optimizer\.params\.lrr: unknown key; did you mean lr\?"),
    ("config fp16 typo", _cfg({"fp16": {"enabeld": True}}), ConfigError,
     r"^fp16\.enabeld: unknown key; did you mean enabled\?"),
    ("config unknown mesh key", _cfg({"mesh": {"tp": 2}}), ConfigError,
     r"^mesh\.tp: unknown key; valid keys: pipeline_parallel_size, tensor_parallel_size"),
    ("config int as text", _cfg({"train_batch_size": "eight"}), ConfigError,
     r'^train_batch_size: "eight" is not allowed; expected an integer > 0, "auto" or null'),
    ("config bool as text", _cfg({"fp16": {"enabled": "yes please"}}), ConfigError,
     r'^fp16\.enabled: "yes please" is not allowed; expected true, false or "auto"'),
    ("config negative accumulation", _cfg({"gradient_accumulation_steps": -1}), ConfigError,
     r"^gradient_accumulation_steps: -1 is not allowed; expected an integer > 0"),
    ("config lr as text", _cfg({"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}}),
     ConfigError, r'^optimizer\.params\.lr: "fast" is not allowed; expected a number >= 0'),
    ("config negative clipping", _cfg({"gradient_clipping": -1.0}), ConfigError,
     r"^gradient_clipping: -1\.0 is not allowed; expected a number >= 0"),
    ("config zero timeout", _cfg({"distributed": {"timeout_minutes": 0}}), ConfigError,
     r"^distributed\.timeout_minutes: 0 is not allowed; expected a number > 0"),
    ("config batch triple != world", _cfg({"train_batch_size": 10,
     "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1}, 2), ConfigError,
     r"train_batch_size 10 != train_micro_batch_size_per_gpu 3 \* gradient_accumulation_steps"
     r" 1 \* data-parallel size 2 = 6; fix one of them or leave one out"),
    ("config batch not divisible", _cfg({"train_batch_size": 9,
     "train_micro_batch_size_per_gpu": 3}, 2), ConfigError,
     r"train_batch_size 9 is not divisible by .* = 6; use a multiple of 6"),
    ("config world size 0", _cfg({}, 0), ConfigError,
     r"world_size 0 is not allowed; use an integer >= 1"),
    ("config fp16 and bf16", _cfg({"fp16": {"enabled": True}, "bf16": {"enabled": True}}),
     ConfigError, r"fp16\.enabled and bf16\.enabled are both true; enable at most one"),
    ("config zero stage 4", _cfg({"zero_optimization": {"stage": 4}}), ConfigError,
     r"^zero_optimization\.stage: 4 is not allowed; use 0, 1, 2 or 3"),
    ("config unknown optimizer", _cfg({"optimizer": {"type": "Adamz"}}), ConfigError,
     r'^optimizer\.type: "Adamz" is not supported; use one of Adam, AdamW'),
    ("config unknown scheduler", _cfg({"scheduler": {"type": "WarmupLRR"}}), ConfigError,
     r'^scheduler\.type: "WarmupLRR" is not supported; use one of WarmupLR'),
    ("config mesh not dividing the world (issue 18)", _cfg({"mesh": {"tensor_parallel_size":
     3}}, 4), ConfigError, r"world size 4 is not divisible by mesh\.pipeline_parallel_size 1 \* "
     r"mesh\.tensor_parallel_size 3 = 3; pick sizes whose product divides 4 \(divisors: 1, 2, "
     r"4\), or launch a multiple of 3 processes"),
    ("config pipeline schedule typo", _cfg({"pipeline": {"schedule": "1f1f"}}), ConfigError,
     r'^pipeline\.schedule: "1f1f" is not allowed; use "gpipe", "1f1b", "interleaved_1f1b", '
     r'"zb_h1", "zbv" or "dualpipev"'),
    ("config virtual stages with gpipe (issue 18)", _cfg({"pipeline": {"schedule": "gpipe",
     "virtual_stages": 2}}), ConfigError, r'^pipeline\.virtual_stages: 2 needs pipeline\.schedule'
     r' "interleaved_1f1b" \(gpipe runs one stage per rank\); set the schedule to '
     r"interleaved_1f1b, or virtual_stages to 1"),
    ("config partition method typo (issue 18)", _cfg({"pipeline": {"partition_method":
     "paramters"}}), ConfigError,
     r'^pipeline\.partition_method: "paramters" is not allowed; did you mean parameters\?'),
    ("config tensor-parallel plan style typo (issue 18)", _cfg({"tensor_parallel": {"plan": {
     "rows": [["layers.*.attn.q_proj", "colum"]]}}}), ConfigError,
     r"^tensor_parallel\.plan: plan 'config plan': row \('layers\.\*\.attn\.q_proj', 'colum'\) "
     r"must be \(path, style\[, units\[, blocks\]\]\) with style one of \('embedding'"),
    ("config nvme offload", _cfg({"zero_optimization": {"stage": 3,
     "offload_param": {"device": "nvme"}}}), ConfigError,
     r'^zero_optimization\.offload_param\.device: "nvme" is not allowed; use "none" or "cpu"'),
    # ---- config files
    ("config file bad JSON", _cfg_file("c.json", '{\n  "train_batch_size": 8,\n}\n'),
     ConfigError, r"c\.json: invalid JSON at line 3, column 1"),
    ("config file bad YAML", _cfg_file("c.yaml", "a: 1\n b: [\n"), ConfigError,
     r"c\.yaml: invalid YAML at line \d+, column \d+"),
    ("config file empty YAML (issue 18)", _cfg_file("c.yml", "# todo\n"), ConfigError,
     r"c\.yml: the YAML config file is empty; write the keys to set, or \{\}"),
    ("config file empty JSON (issue 18)", _cfg_file("c.json", ""), ConfigError,
     r"c\.json: the JSON config file is empty; write the keys to set, or \{\}"),
    ("config file top-level list", _cfg_file("c.json", "[1]"), ConfigError,
     r"c\.json: the top level must be a JSON mapping of keys, not list"),
    ("config file missing", lambda tmp: load_config(tmp / "nope.json"), ConfigError,
     r"nope\.json: no such config file"),
    # ---- data files
    ("data malformed JSONL line", _prepare([*_rows(3), b'{"text": "x"', *_rows(2)]),
     DataError, r"rows\.jsonl:4: malformed JSON .*--skip-bad-rows"),
    ("data row missing its field (issue 18)", _prepare([*_rows(2), b'{"body": "x"}']),
     DataError, r"rows\.jsonl:3: no field 'text' in this row \(its fields: 'body'\); pass "
     r"--text-field"),
    ("data wrong text field everywhere", _prepare(_rows(3), text_field="content"), DataError,
     r"rows\.jsonl:1: no field 'content' .*pass --text-field"),
    ("data non-UTF-8 line", _prepare([*_rows(2), b'{"text": "caf\xe9"}']), DataError,
     r"rows\.jsonl:3: not valid UTF-8 .*--skip-bad-rows"),
    ("data text not a string", _prepare([*_rows(1), b'{"text": 5}']), DataError,
     r"rows\.jsonl:2: field 'text' is int 5, expected a string"),
    ("data empty file", _prepare(b""), DataError, r"no row .*--text-field"),
    ("data truncated token store", _truncated_store, DataError,
     r"tokens\.bin.*(truncated|bytes).*prepare"),
    ("data tokenizer unknown offline (issue 18)", _tokenizer, DataError,
     r"cannot load tokenizer 'no-such-org/no-such-tokenizer'.*Tried: .*no-such-tokenizer "
     r"\(no such folder or file\), .*models--no-such-org--no-such-tokenizer \(not cached\)"
     r".*--tokenizer byte"),
    # ---- checkpoints
    ("checkpoint flipped byte", _ckpt_damaged(_flip, "read"), CheckpointError,
     r"rank00000\.safetensors: tensor '.*' \(bytes \d+\.\.\d+ of the file\) is corrupted: its "
     r"xxh3_64 checksum.*MESHTRAIN_VERIFY=0"),
    ("checkpoint missing shard",
     _ckpt_damaged(lambda d: (d / "t1" / "rank00000.safetensors").unlink()),
     CheckpointError, r"rank00000\.safetensors.* is missing"),
    ("checkpoint truncated manifest", _ckpt_damaged(
        lambda d: (d / "t1" / "manifest.json").write_text(
            (d / "t1" / "manifest.json").read_text()[:100])),
     CheckpointError, r"manifest\.json.*cannot be read as JSON"),
    ("checkpoint latest points nowhere",
     _ckpt_damaged(lambda d: (d / "latest").write_text("global_step999")),
     CheckpointError, r"ckpt/latest names tag .global_step999., but .*write one of \[.t1.\] into it"),
    ("checkpoint wrong model", _ckpt_damaged(lambda d: None, "model"), CheckpointError,
     r"missing in checkpoint \(1\): layer\.extra"),
    # ---- launcher inputs
    ("hostfile bad line", _hostfile("worker-1 slots=2\nworker-2 gpus=2\n"), ConfigError,
     r"hosts:2: 'worker-2 gpus=2' is not 'hostname slots=N' \(e\.g\. 'worker-1 slots=8'\)"),
    ("hostfile option injection (issue 18)",
     _hostfile("-oProxyCommand=touch${IFS}/tmp/pwned slots=1\n"), ConfigError,
     r"hosts:1: '-oProxyCommand=.*' is not a host name .*may not start with '-'.*fix the line"),
    ("hostfile shell characters (issue 18)", _hostfile("node1;reboot slots=1\n"), ConfigError,
     r"hosts:1: 'node1;reboot' is not a host name"),
    ("hostfile duplicate host", _hostfile("a slots=1\na slots=2\n"), ConfigError,
     r"hosts:2: host 'a' is listed twice"),
    ("hostfile zero slots", _hostfile("a slots=0\n"), ConfigError,
     r"hosts:1: a has slots=0; need at least 1"),
    # ---- TrainingArguments and Accelerator arguments
    ("TrainingArguments argument typo (issue 18)", _args(evalution_strategy="steps"),
     ConfigError, r"^TrainingArguments: unknown argument 'evalution_strategy'; did you mean "
     r"evaluation_strategy\?"),
    ("TrainingArguments flag as a string (issue 18)", _args(bf16="false"), ConfigError,
     r"^TrainingArguments\.bf16: 'false' is not allowed; use True or False \(a non-empty "
     r"string counts as True\)"),
    ("TrainingArguments seed as a string (issue 18)", _args(seed="42"), ConfigError,
     r"^TrainingArguments\.seed: '42' is not allowed; use an integer"),
    ("TrainingArguments mesh typo (issue 18)", _args(mesh={"tp": 2}), ConfigError,
     r"^TrainingArguments\.mesh\.tp: unknown key; valid keys: pipeline_parallel_size, "
     r"tensor_parallel_size, context_parallel_size, expert_parallel_size$"),
    ("TrainingArguments best without evaluation (issue 18)", _args(save_strategy="best"),
     ConfigError, r'^TrainingArguments\.save_strategy "best" saves after an evaluation .*'
     r'eval_strategy is "no", so nothing would ever be saved; set eval_strategy to "steps"'),
    ("Accelerator accumulation as text (issue 18)",
     _accelerator(gradient_accumulation_steps="two"), ConfigError,
     r"^Accelerator\(gradient_accumulation_steps='two'\): expected an integer >= 1$"),
    ("Accelerator config a list (issue 18)", _accelerator(config=[1, 2]), ConfigError,
     r"^Accelerator\(config=\.\.\.\): list is not allowed; pass a dict, a path to a JSON/YAML "
     r"config or a meshtrain Config$"),
    # ---- `meshtrain serve MODEL` with a save_pretrained folder gone wrong
    ("serve folder without weights (issue 18)",
     _served(lambda d: (d / "model.safetensors").unlink()), ServeError,
     r"/model has config\.json but no weights \(none of model\.safetensors, .*\); save the "
     r"model into it with model\.save_pretrained"),
    ("serve truncated safetensors (issue 18)", _served(lambda d: (d / "model.safetensors")
     .write_bytes((d / "model.safetensors").read_bytes()[:1000])), ServeError,
     r"/model/model\.safetensors is damaged \(truncated or not a safetensors file: .*\); save "
     r"the model again with save_pretrained"),
    ("serve weights of another model (issue 18)",
     _served(lambda d: _edit_config(d, vocab_size=7)), ServeError,
     r"/model: the weights do not fit config\.json: 1 tensor\(s\) differ in shape \(bert\."
     r"embeddings\.word_embeddings\.weight: model\.safetensors has \[\d+, 32\], config\.json "
     r"\[7, 32\]\)\. The config and the weights come from different models: save both"),
    ("serve config.json not JSON (issue 18)",
     _served(lambda d: (d / "config.json").write_text('{"model_type": "bert",')), ServeError,
     r"/model/config\.json:1:23: not valid JSON \(.*\); save the model again with "
     r"save_pretrained"),
    ("serve tokenizer.json not JSON (issue 18)",
     _served(lambda d: (d / "tokenizer.json").write_text("{")), ServeError,
     r"/model/tokenizer\.json: the JSON ends early \(the file is truncated or incomplete\) at "
     r"line 1, column 2: .*; save the tokenizer again with tokenizer\.save_pretrained, or "
     r"pass --tokenizer"),  # read through files/ first (issue 32): one line, truncation named
    # ---- the output folder of `meshtrain train`
    ("output dir is a file (issue 18)", _output_dir(lambda t: (t / "f").write_text("x") and
     t / "f"), ConfigError, r"train\.output_dir: .*/f exists and is a file, not a folder; "
     r"pick another --output-dir"),
    ("output dir under a file (issue 18)", _output_dir(lambda t: (t / "f").write_text("x") and
     t / "f" / "run"), ConfigError, r"train\.output_dir: cannot create .*/f/run: a part of "
     r"that path is a file.*pick another --output-dir"),
    ("output dir not creatable (issue 18)", _output_dir(lambda t: Path("/sys/meshtrain-run")),
     ConfigError, r"train\.output_dir: cannot create /sys/meshtrain-run \(.*\); pick a folder"),
    ("output dir read-only (issue 18)", _output_dir(lambda t: Path("/sys/kernel")),
     ConfigError, r"train\.output_dir: cannot write into /sys/kernel .*Fix its permissions "
     r"or pick another --output-dir"),
    ("output dir used by another run (issue 18)", _held_lock, ConfigError,
     r"train\.output_dir: .* is in use by another meshtrain train run \(pid \d+ on host "
     r"\S+, started .*\).*pick another --output-dir"),
    # ---- training numerics
    ("NaN loss in fp32 (issue 18)", _scaler("fp32"), TrainingError,
     r"non-finite loss or gradient \(inf/NaN\) at step 10 in fp32 .*10 steps in a row .*"
     r"Try: lower the learning rate.*gradient_clipping"),
    ("NaN loss in bf16 (issue 18)", _scaler("bf16"), TrainingError,
     r"non-finite loss or gradient \(inf/NaN\) at step 10 in bf16"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "run", "error", "pattern"), CASES, ids=[c[0] for c in CASES])
def test_bad_input(tmp_path, monkeypatch, name, run, error, pattern):
    monkeypatch.setenv("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "0"))
    with pytest.raises(Exception) as info:
        run(tmp_path)
    assert type(info.value) is error, f"{name}: {type(info.value).__name__}: {info.value}"
    assert re.search(pattern, str(info.value), re.S), f"{name}: {info.value}"
    if name.startswith("NaN loss in bf16"):
        assert "train in bf16" not in str(info.value)  # the fp16 advice, to a bf16 run


def test_catalogue_size():
    assert len(CASES) >= 40


def _launch(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    from tests.launch import clean_env

    return subprocess.run(
        [sys.executable, "-m", "meshtrain", "launch", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=clean_env(PYTHONPATH=os.pathsep.join(sys.path)),
    )


def test_launcher_missing_script_and_port_in_use(tmp_path):
    """Issue 18: both used to start the agent (a missing script) or print a 46-line
    traceback ending in EADDRINUSE; now one ``meshtrain launch: error`` line, exit 2."""
    out = _launch("--nproc_per_node", "2", str(tmp_path / "nope.py"))
    assert out.returncode == 2, out.stderr
    assert re.search(
        r"meshtrain launch: error: SCRIPT '.*nope\.py' does not exist .*-m", out.stderr
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = _launch("--nproc_per_node", "2", "--master_port", str(port),
                      str(REPO / "examples" / "launch_hello.py"))  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert f"meshtrain launch: error: port {port} is already in use" in out.stderr
    assert "pick a free port with --master_port" in out.stderr
    assert "Traceback" not in out.stderr


def test_serve_port_in_use(tmp_path, capsys):
    """Issue 18: ``meshtrain serve`` on a port in use loaded the model, printed the address
    it would serve on, then uvicorn's "[Errno 98] ... address already in use", exit 3.
    Now one ``meshtrain serve: error`` line, exit 2, before anything is loaded."""
    from meshtrain import cli

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc = cli.main(["serve", str(tmp_path / "model"), "--port", str(port)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert re.fullmatch(
        rf"meshtrain serve: error: cannot listen on 127\.0\.0\.1:{port} \(Address already in "
        r"use\); another server may hold the port: pick another with --port, or check --host\n",
        err,
    ), err

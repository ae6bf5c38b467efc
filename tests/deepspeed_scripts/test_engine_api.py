"""The engine members DeepSpeed scripts call, with DeepSpeed's meanings, at 2 ranks.

One process group checks the batch-size queries, ranks, precision and stage queries,
``step()``'s boundary flag, ``save_16bit_model`` (whole bf16 weights under ZeRO-3, as
``torch.save`` or safetensors), ``save_checkpoint(save_dir, tag, client_state)``, and
``load_checkpoint``: ``(path, client_state)`` for a checkpoint, ``(None, None)`` when
there is nothing to load (no directory, an empty one, a missing tag), and an error that
names the tags when complete tags exist but ``latest`` does not.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.harness import run_ranks


def _config(**extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        **extra,
    }


def _ranks(tmp: str):
    from pathlib import Path

    import meshtrain
    from meshtrain.errors import CheckpointError

    torch.manual_seed(0)
    engine, *_ = meshtrain.initialize(model=nn.Linear(4, 2), config=_config())
    facts = {
        "micro": engine.train_micro_batch_size_per_gpu(),
        "gas": engine.gradient_accumulation_steps(),
        "batch": engine.train_batch_size(),
        "stage": engine.zero_optimization_stage(),
        "fp16": engine.fp16_enabled(),
        "bf16": engine.bfloat16_enabled(),
        "ranks": (engine.global_rank, engine.world_size, engine.dp_world_size, engine.local_rank),
        "device": str(engine.device),
    }
    bf16, *_ = meshtrain.initialize(model=nn.Linear(4, 2), config=_config(bf16={"enabled": True}))
    facts["bf16_engine"] = (bf16.bfloat16_enabled(), bf16.fp16_enabled())
    # save_16bit_model: whole weights in the training dtype, under ZeRO-3 too
    z3, *_ = meshtrain.initialize(
        model=nn.Linear(4, 2),
        config=_config(bf16={"enabled": True}, zero_optimization={"stage": 3}),
    )
    z3.save_16bit_model(tmp)  # pytorch_model.bin, as DeepSpeed names it
    z3.save_16bit_model(tmp, "model.safetensors")
    from safetensors.torch import load_file

    whole = z3.module_state_dict()
    for got in (torch.load(f"{tmp}/pytorch_model.bin", weights_only=True),
                load_file(f"{tmp}/model.safetensors")):  # fmt: skip
        facts.setdefault("export16", []).append(
            sorted(got) == sorted(whole)
            and all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], whole[k]) for k in got)
        )

    boundaries = []
    for _ in range(4):
        loss = engine(torch.randn(3, 4)).pow(2).mean()
        engine.backward(loss)
        before = engine.is_gradient_accumulation_boundary()
        boundaries.append((before, engine.step()))
    facts["boundaries"] = boundaries
    facts["applied"] = engine.was_step_applied()
    facts["grad_norm"] = engine.get_global_grad_norm() is not None

    root = Path(tmp)
    facts["missing_dir"] = engine.load_checkpoint(root / "nowhere")
    (root / "empty").mkdir(exist_ok=True)
    facts["empty_dir"] = engine.load_checkpoint(root / "empty")
    saved = engine.save_checkpoint(root / "ckpt", "first", {"epoch": 3})
    facts["saved"] = Path(saved).name
    path, client = engine.load_checkpoint(root / "ckpt")
    facts["loaded"] = (Path(path).name, client)
    facts["missing_tag"] = engine.load_checkpoint(root / "ckpt", tag="second")
    if engine.global_rank == 0:
        (root / "ckpt" / "latest").unlink()
    torch.distributed.barrier()
    try:
        engine.load_checkpoint(root / "ckpt")
        facts["no_latest"] = "loaded"
    except CheckpointError as exc:
        facts["no_latest"] = str(exc)
    return facts


def test_engine_members_have_deepspeed_meanings(tmp_path):
    for rank, f in enumerate(run_ranks(_ranks, 2, str(tmp_path))):
        assert (f["micro"], f["gas"], f["batch"], f["stage"]) == (3, 2, 12, 2)
        assert (f["fp16"], f["bf16"], f["bf16_engine"]) == (False, False, (True, False))
        assert f["export16"] == [True, True]
        assert f["ranks"] == (rank, 2, 2, rank) and f["device"] == "cpu"
        assert f["boundaries"] == [(False, False), (True, True), (False, False), (True, True)]
        assert f["applied"] and f["grad_norm"]
        assert f["missing_dir"] == (None, None) and f["empty_dir"] == (None, None)
        assert f["missing_tag"] == (None, None)
        assert f["saved"] == "first" and f["loaded"] == ("first", {"epoch": 3})
        assert "pass tag= one of ['first']" in f["no_latest"]

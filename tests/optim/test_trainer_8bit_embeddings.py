"""``TrainingArguments(optim="adamw_8bit")``: embeddings keep 32-bit optimizer state, as in
transformers' Trainer.

transformers' Trainer registers ``{"optim_bits": 32}`` with bitsandbytes'
``GlobalOptimManager`` for every ``nn.Embedding`` weight when it builds an 8-bit
bitsandbytes optimizer; meshtrain marks those weights (``optim.keep_embeddings_32bit``)
and the mark follows them into the ZeRO master slices the optimizer steps.

Protocol: a tiny Llama (vocabulary 256 x 64: 16,384 elements, above bitsandbytes'
``min_8bit_size`` of 4096, so 8-bit state without the rule), the same 8 rows as the whole
global batch of each of 6 steps, constant lr. transformers' Trainer in one process is the
reference; meshtrain's Trainer runs at one process (ZeRO 0) and at ZeRO-2 on 2 ranks
(4 rows each; the embedding then split over the ranks' master slices).

Checked: the embedding's optimizer state is fp32 (m and v) on every rank, while a large
linear's is 8-bit (uint8), in both trainers; the losses are within 1e-4 relative of
transformers' (the same updates in fp32; the 2-rank run differs by the summation order of
the data-parallel mean, and blockwise 8-bit states see the same 256-element blocks) and
the trained embedding within 1e-4 relative. The state dtypes are what tells the rule
apart: with the embedding in 8-bit state (the rule switched off) the losses moved only
by about 1e-5 relative over these 6 steps, and the dtype assertion failed.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks

pytest.importorskip("bitsandbytes")

STEPS, ROWS, SEQ, TOL = 6, 8, 8, 1e-4
MIN_8BIT = 4096  # bitsandbytes' min_8bit_size: smaller tensors keep 32-bit state


def _model():
    from tests.tiny_models import tiny_llama

    return tiny_llama(0, hidden_size=64, intermediate_size=128, vocab_size=256)


def _rows() -> list[dict]:
    ids = torch.randint(0, 256, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": r, "labels": r} for r in ids]


def _args(cls, out: str, per_device: int, **extra):
    return cls(
        output_dir=out, per_device_train_batch_size=per_device, max_steps=STEPS,
        learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        logging_steps=1, save_strategy="no", report_to="none", seed=0, optim="adamw_8bit",
        **extra,
    )  # fmt: skip


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _state_dtypes(optimizer, params) -> set[str]:
    return {
        str(t.dtype)
        for p in params
        for k, t in optimizer.state.get(p, {}).items()
        if k in ("state1", "state2") and isinstance(t, torch.Tensor)
    }


def _transformers(out: str) -> dict:
    import transformers

    model = _model()
    args = _args(transformers.TrainingArguments, out, ROWS, use_cpu=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_rows())
    trainer.train()
    opt = trainer.optimizer
    opt = getattr(opt, "optimizer", opt)  # accelerate's wrapper
    embed = model.get_input_embeddings().weight
    return {
        "losses": _losses(trainer),
        "embed": embed.detach().clone(),
        "embed_state": _state_dtypes(opt, [embed]),
        "mlp_state": _state_dtypes(opt, [model.model.layers[0].mlp.up_proj.weight]),
    }


def _meshtrain(out: str, stage: int) -> dict:
    import torch.distributed as dist

    import meshtrain

    world = dist.get_world_size() if dist.is_initialized() else 1
    model = _model()
    ds = {"zero_optimization": {"stage": stage}}
    args = _args(meshtrain.TrainingArguments, out, ROWS // world, deepspeed=ds)
    trainer = meshtrain.Trainer(model=model, args=args, train_dataset=_rows())
    trainer.train()
    engine = trainer.engine
    leaves = [p for g in engine.optimizer.param_groups for p in g["params"]]
    marked = [p for p in leaves if getattr(p, "meshtrain_optim_bits", 0)]
    large = [
        p
        for p in leaves
        if not getattr(p, "meshtrain_optim_bits", 0) and p.meshtrain_whole_numel >= 8192
    ]
    embed = dict(engine.module_state_dict())["model.embed_tokens.weight"]
    report = engine.memory_report()
    small = sum(p.numel() for p in model.parameters() if p.numel() < MIN_8BIT)
    return {
        "optimizer_bytes": (report.measured.optimizer, report.formula.optimizer),
        "small_numel": small,
        "losses": _losses(trainer),
        "embed": embed.detach().clone(),
        "embed_state": _state_dtypes(engine.optimizer, marked),
        "marked_numel": sum(p.numel() for p in marked),
        "mlp_state": _state_dtypes(engine.optimizer, large),
    }


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_embeddings_keep_32bit_state_as_in_transformers(tmp_path):
    # separate processes: transformers' override lives in bitsandbytes' process-global
    # GlobalOptimManager, keyed by id(), which a later run's tensors can reuse
    (ref,) = run_ranks(_transformers, 1, str(tmp_path / "hf"))
    (one,) = run_ranks(_meshtrain, 1, str(tmp_path / "mt"), 0)
    z2 = run_ranks(_meshtrain, 2, str(tmp_path / "z2"), 2)

    assert ref["embed_state"] == {"torch.float32"}, ref  # transformers' rule, as measured
    assert ref["mlp_state"] == {"torch.uint8"}, ref
    # ZeRO-2 shards by bucket chunk: a rank may hold none of the embedding's master
    assert set().union(*(r["embed_state"] for r in z2)) == {"torch.float32"}, z2
    for got in (one, *z2):
        assert got["embed_state"] == ({"torch.float32"} if got["marked_numel"] else set())
        assert got["mlp_state"] <= {"torch.uint8"}, got["mlp_state"]
        worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"], strict=True))
        assert worst < TOL, (worst, got["losses"], ref["losses"])
        assert _rel(got["embed"], ref["embed"]) < TOL, _rel(got["embed"], ref["embed"])
    assert one["mlp_state"] == {"torch.uint8"}
    # memory_report's formula counts the embedding's 32-bit state: what it leaves out is
    # bitsandbytes' own rule for tensors under MIN_8BIT elements (32-bit state: at most 8
    # bytes each in this fp32 run); without the embedding rule the formula was 16,384 x ~6
    # bytes further off, beyond this bound
    measured, formula = one["optimizer_bytes"]
    assert 0 <= measured - formula <= 8 * one["small_numel"], (measured, formula)
    assert one["marked_numel"] == 256 * 64  # the whole embedding on one rank
    assert sum(r["marked_numel"] for r in z2) == 256 * 64  # split over the 2 ranks' slices

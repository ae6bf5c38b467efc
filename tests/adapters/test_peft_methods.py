"""Prompt tuning, prefix tuning and IA3 (peft) through the engine at every ZeRO stage.

For each method, on the tiny Llama (fp32), 4 AdamW steps on 2 ranks (2 rows each) at
stages 0, 1, 2 and 3 against one process on the same 4 rows per step:

* losses within ``trajectory(1e-2, 4)`` relative (``tests/tolerance.py``; fp32; the runs
  differ only in the order of the data-parallel gradient sum, carried by Adam's
  normalised update);
* the base model's weights bit-unchanged (read from the gathered state dict, so stage 3's
  shards are checked too) and the optimizer holds the adapter only;
* the adapter saved from the gathered state (``accelerate.peft_io.save_model`` inside
  ``whole_for_save``, what ``Accelerator.save_model`` does; peft runs a prompt encoder
  while saving, which under ZeRO-3 hung before) holds adapter tensors only, loads in plain
  ``PeftModel.from_pretrained`` and gives the trained model's logits (within
  ``evaluation()`` of the largest logit: the same weights, evaluated again).
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.tolerance import check, evaluation, trajectory

pytest.importorskip("peft")

STEPS, ROWS, SEQ = 4, 2, 8
METHODS = ("prompt", "prefix", "ia3")


def _peft_config(method: str):
    import peft

    if method == "prompt":
        return peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    if method == "prefix":
        return peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    return peft.IA3Config(
        task_type="CAUSAL_LM",
        target_modules=["k_proj", "v_proj", "down_proj"],
        feedforward_modules=["down_proj"],
    )


def _model(method: str):
    import peft

    from tests.tiny_models import tiny_llama

    base = tiny_llama(0)
    torch.manual_seed(1)
    model = peft.get_peft_model(base, _peft_config(method))
    if method == "ia3":  # IA3 starts at ones (identity): move it so the test sees it act
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.1 * torch.randn_like(p))
    return model.train()


def _batch(step: int, rows: int) -> torch.Tensor:
    return torch.randint(0, 64, (rows, SEQ), generator=torch.Generator().manual_seed(step))


def _reference(method: str) -> list[float]:
    model = _model(method)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        ids = _batch(step, 2 * ROWS)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _run(method: str, stage: int, tmp: str) -> dict:
    from pathlib import Path

    import torch.distributed as dist

    import meshtrain
    from meshtrain.accelerate.peft_io import save_model, whole_for_save

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(method)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    base_before = {k: v.clone() for k, v in model.state_dict().items() if k not in trainable}
    engine, *_ = meshtrain.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config={
            "train_micro_batch_size_per_gpu": ROWS,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "steps_per_print": 1000,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        },
    )
    losses = []
    for step in range(STEPS):
        ids = _batch(step, ROWS * world)[rank * ROWS : (rank + 1) * ROWS]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        t = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(float(t) / world)
    state = engine.module_state_dict()
    out = {
        "losses": losses,
        "base_unchanged": all(torch.equal(state[k], v) for k, v in base_before.items()),
        "optimizer_numel": sum(
            p.numel() for g in engine.optimizer.param_groups for p in g["params"]
        ),
        "trainable_numel": engine.zero.trainable_numel,
    }
    directory = Path(tmp) / f"{method}-{stage}"
    with whole_for_save(engine, model):  # collective: prompt encoders run while saving
        if rank == 0:
            save_model(model, state, directory)
    dist.barrier()
    ids = _batch(99, 2)
    model.eval()
    with torch.no_grad():
        out["logits"] = engine(input_ids=ids).logits
    out["dir"] = str(directory)
    return out


def _all(method: str, tmp: str) -> list[dict]:
    return [_run(method, stage, tmp) for stage in (0, 1, 2, 3)]


@pytest.mark.parametrize("method", METHODS)
def test_peft_method_at_every_zero_stage(method, tmp_path):
    import peft
    from safetensors.torch import load_file

    from tests.tiny_models import tiny_llama

    ref = _reference(method)
    per_stage = run_ranks(_all, 2, method, str(tmp_path))[0]
    n_adapter = sum(p.numel() for p in _model(method).parameters() if p.requires_grad)
    for stage, got in enumerate(per_stage):
        for step, (a, b) in enumerate(zip(got["losses"], ref, strict=True)):
            check(
                f"{method} stage {stage} loss {step}", abs(a - b) / abs(b), trajectory(1e-2, STEPS)
            )
        assert got["base_unchanged"], (method, stage)
        assert got["trainable_numel"] == n_adapter
        saved = load_file(f"{got['dir']}/adapter_model.safetensors")
        assert sum(v.numel() for v in saved.values()) == n_adapter, list(saved)
        reloaded = peft.PeftModel.from_pretrained(tiny_llama(0), got["dir"]).eval()
        with torch.no_grad():
            logits = reloaded(input_ids=_batch(99, 2)).logits
        bound = evaluation() * float(got["logits"].abs().max())
        check(f"{method} stage {stage} logits", float((logits - got["logits"]).abs().max()), bound)

"""LoRA (peft) through the Accelerator under ZeRO stages 0-3 at 2 processes vs 1 process.

For each stage, on a tiny random BERT with LoRA on ``query``/``value`` (dropout 0):

* adapter weights (normwise, each tensor within ``per_tensor``) within
  ``trajectory(1e-2, 2)`` of the one-process run on the same global batch
  (``tests/tolerance.py``; fp32; the two runs differ only in the order of the gradient
  sums);
* base weights bit-unchanged; the flat groups and the optimizer hold the adapter only;
* bytes per optimizer step count only the adapter's parameters, asserted exactly: the
  engine's recorded bytes (minus the gradient-norm scalar) equal both the plan's theory
  and the closed form from the adapter's element count (2 x 4 Psi for stages 0-2; no
  padding: every LoRA matrix, and every frozen unit bucket, has an even element count);
* stage 3 shards the frozen base too: gradient traffic is the adapter's alone (a
  reduce-scatter of 4 Psi), the all-gathers are the adapter's 2 x 4 Psi plus the frozen
  weights' 4 (Phi + Phi - Phi_emb) (every unit gathered for forward, and again for
  backward except the embeddings, whose output needs no gradient); each rank holds
  exactly 4 Phi / 2 bytes of frozen shards, the estimator's
  ``model_states_bytes(..., frozen_params=Phi)`` difference, and the memory report's
  measured parameter bytes equal the estimator's at every stage (exact: no padding);
* stage 3 (adapters sharded: persistence threshold 0): the saved adapter is non-empty and
  equals the gathered one bit for bit; plain ``PeftModel.from_pretrained`` loads it and
  gives the trained model's logits (within ``evaluation()`` of the largest logit: same
  weights, same kernels, another batch); the merged export loads in plain transformers
  (``BertForSequenceClassification.from_pretrained``) with logits within ``evaluation()``
  of the largest of the peft model's (merging adds ``scaling x B @ A`` into ``W``: a
  reassociation of the same sum),
  and so does ``meshtrain consolidate CKPT OUT --merge-lora ADAPTER`` of an engine checkpoint;
  ``save_state`` / ``load_state`` resumes bit-exactly; ``ZeroStage.release_module`` (the
  Trainer's end of training) leaves the module whole, frozen base included.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.tolerance import check, check_weights, evaluation, trajectory

GLOBAL_BATCH = 8
STEPS = 2
SEQ = 6


def _bert():
    from tests.tiny_models import tiny_bert

    return tiny_bert(
        vocab_size=64, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16, num_labels=2, attn_implementation=None,
    )  # fmt: skip


def _frozen_numel(model, under: str = "") -> int:
    return sum(p.numel() for n, p in model.named_parameters() if not p.requires_grad and under in n)


def _lora(model):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["query", "value"])
    peft_model = get_peft_model(model, cfg)
    torch.manual_seed(1)  # peft zero-initialises B; make the adapter do something at once
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    return peft_model


def _data():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 64, (GLOBAL_BATCH * STEPS, SEQ), generator=g)
    labels = torch.randint(0, 2, (GLOBAL_BATCH * STEPS,), generator=g)
    return [{"input_ids": i, "labels": y} for i, y in zip(ids, labels, strict=True)]


def _setup(stage: int, world: int):
    from torch.utils.data import DataLoader

    from meshtrain import Accelerator

    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    # seed=: a fixed shuffle seed, so 1 and 2 processes deal the same global order
    # (accelerate's default draws it from the global RNG, differently per world size)
    acc = Accelerator(config={"zero_optimization": zero}, seed=0)
    model = _lora(_bert())
    base0 = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    base0["frozen_numel"] = (_frozen_numel(model), _frozen_numel(model, ".embeddings."))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loader = DataLoader(_data(), batch_size=GLOBAL_BATCH // world, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    return acc, model, opt, loader, base0


def _train(acc, model, opt, loader, stop_after=None):
    model.train()
    for i, batch in enumerate(loader):
        acc.backward(model(**batch).loss)
        opt.step()
        opt.zero_grad()
        if i + 1 == stop_after:
            break


def _lora_sd(state):
    return {k: v for k, v in state.items() if "lora_" in k}


def _stage(stage: int, world: int, tmp: str) -> dict:
    import os

    from safetensors.torch import load_file

    from meshtrain.estimate.model_states import model_states_bytes

    acc, model, opt, loader, base0 = _setup(stage, world)
    phi, phi_emb = base0.pop("frozen_numel")
    engine = acc.engine
    report = engine.memory_report()
    _train(acc, model, opt, loader)
    b = engine.last_step_comm_bytes()
    state = acc.get_state_dict(model)
    adapter = _lora_sd(state)
    psi = sum(v.numel() for v in adapter.values())
    out = {
        "adapter": adapter,
        "base_unchanged": all(torch.equal(state[k], v) for k, v in base0.items()),
        "trainable_numel": engine.zero.trainable_numel,
        "psi": psi,
        "opt_state_numel": sum(
            s["exp_avg"].numel() for s in engine.optimizer.state.values() if "exp_avg" in s
        ),
        "bytes": (b["total"] - b.get("control", 0), engine.zero.comm_bytes_theory(1)),
        "by_op": b,
        "phi": (phi, phi_emb),
        "frozen_shard_bytes": sum(g.state_bytes()["params"] for g in engine.zero.frozen_groups),
        "params_bytes": (report.measured.params, report.formula.params),
        "estimator_frozen_bytes": [
            model_states_bytes(
                psi, dp=world, stage=stage, precision="fp32", optimizer="AdamW", frozen_params=f
            ).params
            for f in (phi, 0)
        ],
    }
    if stage == 3:
        ids = torch.arange(1, 1 + 2 * SEQ).reshape(2, SEQ)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        adapter_dir, merged_dir, state_dir = (
            os.path.join(tmp, n) for n in ("lora", "merged", "state")
        )
        acc.save_model(model, adapter_dir)
        acc.save_model(model, merged_dir, merge_lora=True)
        ckpt_dir, cli_dir = os.path.join(tmp, "ckpt"), os.path.join(tmp, "cli_merged")
        acc.engine.save_checkpoint(ckpt_dir)
        acc.wait_for_everyone()
        if acc.is_main_process:
            from peft import PeftModel
            from transformers import BertForSequenceClassification

            saved = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
            out["saved"] = saved
            loaded = PeftModel.from_pretrained(_bert(), adapter_dir).eval()
            merged = BertForSequenceClassification.from_pretrained(merged_dir).eval()
            from meshtrain.cli import main as cli

            argv = ["consolidate", ckpt_dir, cli_dir, "--merge-lora", adapter_dir]
            out["cli_rc"] = cli(argv)
            from_cli = BertForSequenceClassification.from_pretrained(cli_dir).eval()
            with torch.no_grad():
                out["logits_scale"] = logits.abs().max().item()
                out["peft_loaded_diff"] = (loaded(input_ids=ids).logits - logits).abs().max().item()
                out["merged_diff"] = (merged(input_ids=ids).logits - logits).abs().max().item()
                out["cli_diff"] = (from_cli(input_ids=ids).logits - logits).abs().max().item()
        # exact resume under stage 3
        acc, model, opt, loader, _ = _setup(stage, world)
        _train(acc, model, opt, loader, stop_after=1)
        acc.save_state(state_dir)
        acc, model, opt, loader, _ = _setup(stage, world)
        acc.load_state(state_dir)
        _train(acc, model, opt, loader)
        out["resumed"] = _lora_sd(acc.get_state_dict(model))
        # the end of training (the Trainer's): the user's module whole again, frozen base
        # included, with the same values the gathered state dict has
        whole = acc.get_state_dict(model)
        engine = acc.engine
        engine.zero.release_module(engine.module)
        released = engine.module.state_dict()
        out["released_equal"] = all(torch.equal(released[k], v) for k, v in whole.items())
    return out


def _run(tmp: str, stages: tuple[int, ...]) -> dict:
    world = torch.distributed.get_world_size()
    return {s: _stage(s, world, tmp) for s in stages}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    one = run_ranks(_run, 1, str(tmp_path_factory.mktemp("one")), (0,))[0]
    two = run_ranks(_run, 2, str(tmp_path_factory.mktemp("two")), (0, 1, 2, 3))
    return one, two


def test_lora_every_stage_matches_one_process_and_moves_adapter_bytes_only(runs):
    one, two = runs
    ref = one[0]["adapter"]
    for stage in (0, 1, 2, 3):
        for r in (0, 1):
            got = two[r][stage]
            assert got["base_unchanged"], f"stage {stage}: a frozen base weight changed"
            check_weights(f"stage {stage} rank {r}", got["adapter"], ref, trajectory(1e-2, STEPS))
            psi = got["psi"]
            assert got["trainable_numel"] == psi
            assert got["opt_state_numel"] == (psi if stage == 0 else psi // 2)
            moved, theory = got["bytes"]
            measured, formula = got["params_bytes"]
            assert measured == formula, (stage, measured, formula)  # memory report: exact
            with_frozen, without = got["estimator_frozen_bytes"]
            phi, phi_emb = got["phi"]
            if stage < 3:
                assert moved == theory == 2 * 4 * psi, (stage, moved, theory)
                assert got["frozen_shard_bytes"] == 0  # frozen weights whole: 4 Phi
                assert with_frozen - without == 4 * phi
                continue
            by_op = got["by_op"]
            assert theory == 3 * 4 * psi  # the plan's theory: the adapter's buckets
            assert by_op["reduce_scatter"] == 4 * psi  # gradient traffic: adapter only
            assert by_op["all_gather"] == 2 * 4 * psi + 4 * (2 * phi - phi_emb), by_op
            assert moved == by_op["all_gather"] + by_op["reduce_scatter"]
            # frozen base sharded: exactly half of it per rank, as the estimator says
            assert got["frozen_shard_bytes"] == with_frozen - without == 4 * phi // 2


def test_stage3_adapter_save_load_merge_and_resume(runs):
    _, two = runs
    got = two[0][3]
    saved, gathered = got["saved"], got["adapter"]
    assert saved and all(v.numel() > 0 for v in saved.values())
    assert len(saved) == len(gathered)
    for k, v in gathered.items():
        assert torch.equal(saved[k.replace(".default", "")], v), k
    bound = evaluation() * got["logits_scale"]
    check("PeftModel.from_pretrained logits", got["peft_loaded_diff"], bound)
    check("merged export logits", got["merged_diff"], bound)
    assert got["cli_rc"] == 0  # meshtrain consolidate --merge-lora
    check("consolidate --merge-lora logits", got["cli_diff"], bound)
    for r in (0, 1):
        for k, v in two[r][3]["adapter"].items():
            assert torch.equal(two[r][3]["resumed"][k], v), f"rank {r}: resume differs at {k}"
        assert two[r][3]["released_equal"], f"rank {r}: release_module lost values"

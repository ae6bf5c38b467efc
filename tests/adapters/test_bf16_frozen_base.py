"""LoRA on a base loaded in bf16, trained in fp32 (no ``bf16=True``): the frozen base stays
bf16 (``meshtrain.parallel.placement``), as transformers' Trainer leaves it.

Protocol: one tiny Llama saved once, loaded with ``dtype=torch.bfloat16`` in every
process, peft LoRA r=4 on q/v (peft keeps the adapters fp32 on a bf16 base). The same 8
rows are the whole global batch of each of 10 AdamW steps (constant lr, no warmup), so
the data order cannot differ between the trainers: transformers' Trainer in one process
is the reference; meshtrain's Trainer runs at one process (ZeRO 0) and at ZeRO-3 on 2
ranks (4 rows each).

Also a BERT classifier whose head is trained whole (peft's ``modules_to_save``) on a
bf16 encoder: the fp32 head reads bf16 activations, which ``placement`` casts for it; it
trains, and its first loss equals transformers' within bf16 rounding (the assert says
why). Checked: every frozen floating parameter is still bf16 after training, and the bytes
the rank holds for them are exactly 2 per element (ZeRO 0: the whole base; ZeRO-3:
its bf16 frozen group's shard is ceil(numel / 2) elements of each unit bucket, 2 bytes
each, the whole base only as units are gathered); the trainable parameters are fp32.
Tolerance: each logged loss within 1e-4 relative of transformers' (the bound of the
QLoRA conformance test, ``test_qlora``): both compute the same bf16 matmuls on the same
weights; the 2-rank run differs by the fp32 summation order of the data-parallel mean
and by bf16 rounding of matmuls over 4 rows instead of 8 (measured: 4.3e-6 at one
process and at ZeRO-3).
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks

pytest.importorskip("peft")

STEPS, ROWS, SEQ = 10, 8, 8


def _save_base(path: str) -> str:
    from tests.tiny_models import tiny_llama

    tiny_llama(0, hidden_size=64, intermediate_size=128).save_pretrained(path)
    return path


def _lora(path: str):
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    torch.manual_seed(0)  # the adapters' initial values
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, cfg)


def _rows() -> list[dict]:
    ids = torch.randint(0, 64, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": r, "labels": r} for r in ids]


def _args(cls, out: str, per_device: int, **extra):
    return cls(
        output_dir=out, per_device_train_batch_size=per_device, max_steps=STEPS,
        learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        logging_steps=1, save_strategy="no", report_to="none", seed=0, **extra,
    )  # fmt: skip


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _transformers(path: str, out: str) -> list[float]:
    import transformers

    model = _lora(path)
    args = _args(transformers.TrainingArguments, out, ROWS, use_cpu=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_rows())
    trainer.train()
    return _losses(trainer)


def _frozen_bytes(model, engine) -> dict:
    """Bytes this rank holds for frozen floating parameters, by dtype, and the count of
    elements they stand for."""
    zero = engine.zero
    sharded = {id(p) for g in zero.frozen_groups for p in g.params}
    held: dict[str, int] = {}
    numel = 0
    for g in zero.frozen_groups:
        held[str(g.dtype)] = held.get(str(g.dtype), 0) + g.state_bytes()["params"]
        numel += g.frozen_numel
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and id(p) not in sharded:
            held[str(p.dtype)] = held.get(str(p.dtype), 0) + p.numel() * p.element_size()
            numel += p.numel()
    return {"held": held, "numel": numel}


def _meshtrain(path: str, out: str, stage: int) -> dict:
    import torch.distributed as dist

    import meshtrain

    world = dist.get_world_size() if dist.is_initialized() else 1
    model = _lora(path)
    frozen_numel = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    ds = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    args = _args(meshtrain.TrainingArguments, out, ROWS // world, deepspeed=ds)
    trainer = meshtrain.Trainer(model=model, args=args, train_dataset=_rows())
    trainer.train()
    frozen_dtypes = {str(p.dtype) for p in model.parameters() if not p.requires_grad}
    trainable_dtypes = {str(p.dtype) for p in model.parameters() if p.requires_grad}
    shard_shapes = []  # ZeRO-3: (dtype, this rank's chunk, the bucket's unpadded numel)
    for g in trainer.engine.zero.frozen_groups:
        for b in g.buckets:
            whole = sum(g.shapes[q].numel() for q in b.params)
            shard_shapes.append((str(g.dtype), b.chunk, whole))
    report = trainer.engine.memory_report()
    return {
        "losses": _losses(trainer),
        "report_params": (report.measured.params, report.formula.params),
        "frozen_dtypes": frozen_dtypes,
        "trainable_dtypes": trainable_dtypes,
        "frozen_numel": frozen_numel,
        "shards": shard_shapes,
        **_frozen_bytes(model, trainer.engine),
    }


def _head(out: str) -> dict:
    """A BERT classifier loaded in bf16, LoRA on query/value and the classifier trained
    whole (peft's ``modules_to_save``): the fp32 head reads the bf16 encoder's output
    (``placement``'s input casts). First loss against transformers' Trainer (bf16 head)."""
    import peft
    import transformers

    import meshtrain

    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=32, num_labels=2,
    )  # fmt: skip
    transformers.BertForSequenceClassification(cfg).save_pretrained(out + "/bert")
    ids = torch.randint(1, 64, (ROWS, SEQ), generator=torch.Generator().manual_seed(2))
    rows = [{"input_ids": r, "labels": int(r[0] % 2)} for r in ids]
    losses, kinds = {}, {}
    for name, mod in (("hf", transformers), ("mt", meshtrain)):
        model = transformers.BertForSequenceClassification.from_pretrained(
            out + "/bert", dtype=torch.bfloat16
        )
        torch.manual_seed(0)
        lora = peft.LoraConfig(
            r=4, target_modules=["query", "value"], task_type="SEQ_CLS",
            modules_to_save=["classifier"], lora_dropout=0.0,
        )  # fmt: skip
        model = peft.get_peft_model(model, lora)
        # from_pretrained leaves the BERT in eval mode inside a wrapper whose own flag says
        # training: each dropout's mode as the training forwards run it
        modes = []
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.register_forward_pre_hook(lambda m, a, modes=modes: modes.append(m.training))
        extra = {"use_cpu": True} if name == "hf" else {}
        args = _args(mod.TrainingArguments, f"{out}/{name}", ROWS, **extra)
        trainer = mod.Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
        kinds[name + "_dropout"] = set(modes)
        losses[name] = _losses(trainer)
        kinds[name] = {
            "frozen": {str(p.dtype) for p in model.parameters() if not p.requires_grad},
            "trainable": {str(p.dtype) for p in model.parameters() if p.requires_grad},
        }
    return {"losses": losses, "dtypes": kinds}


def _one_process(path: str, out: str) -> tuple[list[float], dict, dict]:
    return _transformers(path, out + "/hf"), _meshtrain(path, out + "/mt0", 0), _head(out)


def _close(ref: list[float], got: list[float]) -> float:
    assert len(ref) == len(got) == STEPS
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got, strict=True))
    assert worst <= 1e-4, (worst, ref, got)
    return worst


def test_lora_on_a_bf16_base_keeps_the_base_bf16_and_matches_transformers(tmp_path):
    path = _save_base(str(tmp_path / "base"))
    ((ref, one, head),) = run_ranks(_one_process, 1, path, str(tmp_path))
    z3 = run_ranks(_meshtrain, 2, path, str(tmp_path / "mt3"), 3)

    # ZeRO 0: every frozen parameter stays bf16, exactly 2 bytes per element of the base
    assert one["frozen_dtypes"] == {"torch.bfloat16"}, one["frozen_dtypes"]
    assert one["trainable_dtypes"] == {"torch.float32"}, one["trainable_dtypes"]
    assert one["numel"] == one["frozen_numel"]
    assert one["held"] == {"torch.bfloat16": 2 * one["frozen_numel"]}, one["held"]
    # memory_report's formula counts the frozen base by its bf16 bytes, as held
    measured, formula = one["report_params"]
    assert measured == formula, (measured, formula)
    _close(ref, one["losses"])

    # ZeRO-3 on 2 ranks: the frozen base is sharded in one bf16 group (never upcast);
    # each rank holds ceil(numel / 2) elements of every bucket at 2 bytes each
    for r in z3:
        assert r["frozen_dtypes"] == {"torch.bfloat16"}, r["frozen_dtypes"]
        assert r["trainable_dtypes"] == {"torch.float32"}
        assert {d for d, _, _ in r["shards"]} == {"torch.bfloat16"}, r["shards"]
        assert r["numel"] == r["frozen_numel"]  # sharded + kept-whole cover the base
        for _, chunk, whole in r["shards"]:
            assert chunk == -(-whole // 2), (chunk, whole)  # 1/2 of the bucket, padded
        sharded = sum(chunk for _, chunk, _ in r["shards"])
        loose = r["frozen_numel"] - sum(whole for _, _, whole in r["shards"])
        assert r["held"] == {"torch.bfloat16": 2 * (sharded + loose)}, r["held"]
        assert r["held"]["torch.bfloat16"] < 2 * r["frozen_numel"]  # less than the whole
    assert z3[0]["held"] == z3[1]["held"]
    for r in z3:  # ZeRO-3: the formula leaves out bucket padding to 2 ranks (0 measured here)
        measured, formula = r["report_params"]
        assert 0 <= measured - formula <= 0.01 * formula, (measured, formula)
    _close(ref, z3[0]["losses"])

    # a head trained whole on the bf16 encoder: trains, the encoder stays bf16, the head is
    # fp32 here and bf16 in transformers (which casts nothing); the first loss (same
    # weights, before any step) agrees within bf16's rounding of transformers' logits
    # (8 significant bits: 2^-8 relative, for the matmul's inputs, output and the loss;
    # measured 0.0103 relative with dropout on in both (0.0092 when meshtrain ran it
    # off): deterministic, same seeds and operations every run)
    assert head["dtypes"]["mt"]["frozen"] == {"torch.bfloat16"}, head["dtypes"]
    assert head["dtypes"]["mt"]["trainable"] == {"torch.float32"}, head["dtypes"]
    # every dropout ran in training mode, as in transformers' Trainer (it was off in
    # meshtrain's before the Trainer called train() on the whole model at the start)
    assert head["dtypes"]["mt_dropout"] == head["dtypes"]["hf_dropout"] == {True}, head["dtypes"]
    mt, hf = head["losses"]["mt"], head["losses"]["hf"]
    assert len(mt) == STEPS and all(x == x and abs(x) < 1e3 for x in mt), mt
    assert abs(mt[0] - hf[0]) <= 3 * 2**-8 * abs(hf[0]), (mt, hf)


def test_placement_keeps_each_module_in_one_dtype():
    """``place_model`` in fp32: a frozen bf16 linear stays bf16; one whose bias is trainable
    is cast whole (its weight too), so no module mixes dtypes; the fp32 trainable linear
    after the bf16 one gets its input cast. The forward runs and each output has its
    module's dtype."""
    from torch import nn

    from meshtrain.parallel.placement import place_model

    frozen = nn.Linear(4, 4, dtype=torch.bfloat16).requires_grad_(False)
    with_bias = nn.Linear(4, 4, dtype=torch.bfloat16).requires_grad_(False)
    with_bias.bias.requires_grad_(True)
    head = nn.Linear(4, 2, dtype=torch.bfloat16)  # trained whole: follows the precision
    model = place_model(nn.Sequential(frozen, with_bias, head), torch.device("cpu"), torch.float32)
    assert (frozen.weight.dtype, frozen.bias.dtype) == (torch.bfloat16, torch.bfloat16)
    assert (with_bias.weight.dtype, with_bias.bias.dtype) == (torch.float32, torch.float32)
    assert head.weight.dtype == torch.float32
    seen = []
    for m in (frozen, with_bias, head):
        m.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    out = model(torch.randn(3, 4, dtype=torch.bfloat16))
    assert seen == [torch.bfloat16, torch.float32, torch.float32] and out.dtype == torch.float32

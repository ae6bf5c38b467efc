"""Models, batches and the one-process reference of the context-parallel tests
(importable by spawned ranks).

Batches are rows of ``SEQ`` tokens: the first quarter of each row's labels is -100 (a
prompt), row 0 is packed (three documents, position_ids restarting at 0), the others
are single documents. The reference trains one process on the whole global batch with
each data-parallel rank's rows as one accumulated slice (mean loss per slice / dp), which
is what dp x cp computes.
"""

from __future__ import annotations

import torch

from tests.distributed import tp_models

SEQ = 16
ROWS = 2  # rows per data-parallel rank
KINDS = ("decoder", "llama", "gpt2")
LR = 1e-3


def build(kind: str):
    """``tp_models.build`` kinds, plus tiny Qwen2 and Mistral (GQA, sliding window off)."""
    if kind not in ("qwen2", "mistral"):
        return tp_models.build(kind)
    import transformers

    torch.manual_seed(7)
    sizes = dict(
        vocab_size=250, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32,
        attn_implementation="sdpa",
    )  # fmt: skip
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**sizes))
    return transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=None, **sizes))


def batch(step: int, rows: int, seq: int = SEQ) -> dict:
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(1, 250, (rows, seq), generator=g)
    labels = ids.clone()
    labels[:, : seq // 4] = -100
    pos = torch.arange(seq).repeat(rows, 1)
    a, b = seq // 3, seq // 2
    pos[0] = torch.cat((torch.arange(a), torch.arange(b - a), torch.arange(seq - b)))
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def loss_of(model, kind: str, inputs: dict) -> torch.Tensor:
    if kind == "decoder":
        return model(inputs["input_ids"], inputs["labels"], position_ids=inputs["position_ids"])
    # no cache: transformers masks packed documents (from position_ids) only without one
    return model(**inputs, use_cache=False).loss


def reference(kind: str, steps: int, dp: int, seq: int = SEQ) -> tuple[list[float], dict]:
    """One process, ``dp`` accumulated slices of ROWS rows per step: (losses, state)."""
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(steps):
        full = batch(step, ROWS * dp, seq)
        total = 0.0
        for r in range(dp):
            part = {k: v[r * ROWS : (r + 1) * ROWS] for k, v in full.items()}
            loss = loss_of(model, kind, part) / dp
            loss.backward()
            total += float(loss)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_run(kind: str, steps: int, config: dict, topology, seq: int = SEQ):
    """The same training through meshtrain.initialize on ``topology``: (losses averaged
    over dp, full state dict)."""
    import torch.distributed as dist

    import meshtrain
    from meshtrain.distributed import comm

    model = build(kind)
    cfg = {
        "train_micro_batch_size_per_gpu": ROWS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "steps_per_print": 1000,
        **config,
    }
    engine, *_ = meshtrain.initialize(
        model=model, model_parameters=model.parameters(), config=cfg, topology=topology
    )
    dp, r = topology.dp_size, topology.dp_rank
    losses = []
    for step in range(steps):
        full = batch(step, ROWS * dp, seq)
        part = {k: v[r * ROWS : (r + 1) * ROWS] for k, v in full.items()}
        loss = loss_of(engine, kind, part)
        engine.backward(loss)
        engine.step()
        t = loss.detach().double().reshape(1)
        comm.all_reduce(t, topology.dp_group, label="control")
        losses.append(float(t) / dp)
    del dist
    return losses, engine, engine.module_state_dict()


def max_rel(losses: list[float], ref: list[float]) -> float:
    """The worst relative difference of two loss curves."""
    return max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref, strict=True))


def norm_rel(state: dict, ref: dict) -> float:
    """|(||state|| - ||ref||)| / ||ref||: the whole-model parameter norm, relative."""
    n = sum(float(v.double().pow(2).sum()) for v in state.values()) ** 0.5
    m = sum(float(v.double().pow(2).sum()) for v in ref.values()) ** 0.5
    return abs(n - m) / m

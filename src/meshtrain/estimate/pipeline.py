"""Pipeline parallelism in ``meshtrain estimate`` and ``engine.memory_report()``: each pp
rank's model states and its activation memory under the chosen schedule.

**Model states.** The model is cut exactly as the engine cuts it (``split_model`` on the
meta device: no memory, same ``partition_method`` / ``cut_points``, ``pp x v`` stages,
stage ``k`` on pp rank ``k % pp``, or in a V for zbv / dualpipev: ranks ``r`` holds
stages ``r`` and ``2 pp - 1 - r``); pp rank ``r`` holds the distinct parameters of its
stages, ``Psi_r``, and its model states are ``model_states_bytes(Psi_r, dp, stage, ...)``
(ZeRO partitions over the dp ranks holding the same stage). A tied weight (input
embedding = LM head) counts on every rank holding it: each keeps a copy.

**Activations.** A stage keeps, for each micro-batch whose forward is done and whose
backward (``W`` for ZB-H1) is not, what its layers saved for the backward. Per
transformer block and micro-batch of ``b`` sequences of ``s`` tokens, hidden size ``h``,
``a`` heads, activations of ``w`` bytes (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", eq. 1, generalised from ``w = 2``; 1-byte
dropout masks included, so a model without dropout holds a little less)::

    block   s b h (16 w + 2) + a s^2 b (2 w + 1)      (w = 2: s b h (34 + 5 a s / h))
    head    b s V (w + 4)                              (logits + fp32 softmax, last stage)

With activation checkpointing a block keeps only its input (``s b h w``) per micro-batch,
and one block's full activations while it is recomputed. The peak over a step is found by
walking this rank's action list (``schedules.build_schedule``) and adding each stage's
bytes per alive micro-batch; in micro-batches that is GPipe ``m``, 1F1B ``min(m, p - r)``
on rank ``r``, interleaved ``(v - 1) k + 2 (p - 1 - r) + 1`` chunk activations (``k``
micro-batches per round), ZB-H1 ``min(m, p)``, zbv ``min(2 m, 2 p, m + 1 + r)`` and
dualpipev ``2 p + 1`` chunk activations (a chunk: half a 1F1B stage's blocks). Not included: the activations in flight
(one send and one receive buffer per neighbour), temporary buffers, fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from meshtrain.estimate.model_states import ModelStates, model_states_bytes, positive_int

__all__ = ["StageMemory", "TransformerDims", "block_activation_bytes", "pipeline_memory"]


@dataclass(frozen=True)
class TransformerDims:
    """What the activation formula needs: hidden size, heads, vocabulary, longest sequence."""

    hidden: int
    heads: int
    vocab: int
    max_seq_len: int | None = None

    @classmethod
    def of(cls, model: nn.Module) -> TransformerDims | None:
        """From meshtrain's ``Decoder`` or a ``transformers`` model's config, else None."""
        cfg = getattr(model, "config", None)
        pairs = (("dim", "n_heads", "max_seq_len"), ("hidden_size", "num_attention_heads", ""))
        for hid, heads, seq in pairs:
            h, a, v = (getattr(cfg, k, None) for k in (hid, heads, "vocab_size"))
            if all(isinstance(x, int) for x in (h, a, v)):
                longest = getattr(cfg, seq or "max_position_embeddings", None)
                return cls(h, a, v, longest if isinstance(longest, int) else None)
        return None


def block_activation_bytes(
    dims: TransformerDims, b: int, s: int, width: int, checkpointed: bool = False
) -> int:
    """Bytes one transformer block keeps per micro-batch (module docstring)."""
    if checkpointed:
        return s * b * dims.hidden * width
    return s * b * dims.hidden * (16 * width + 2) + dims.heads * s * s * b * (2 * width + 1)


@dataclass(frozen=True)
class StageMemory:
    """One pp rank: its stages, parameters, model states and peak activations."""

    rank: int
    stages: tuple[int, ...]
    blocks: int  # transformer blocks on this rank
    trainable: int  # distinct trainable parameters of its stages
    states: ModelStates
    peak_micro_batches: int  # (chunk) activations alive at the peak, from the action list
    activations: int | None  # bytes at the peak; None without transformer dims / seq_len

    @property
    def total(self) -> int:
        """Device bytes: model states + activations."""
        return self.states.total + (self.activations or 0)


def peak_activations(
    schedule: str, p: int, m: int, v: int, rank: int, per_stage: dict[int, int]
) -> tuple[int, int]:
    """(peak alive (chunk) micro-batches, peak bytes) of ``rank`` walking its action list;
    ``per_stage``: bytes one micro-batch keeps on each of its stages."""
    from meshtrain.parallel.pipeline.schedules import F, build_schedule, frees_activations

    free = frees_activations(schedule)
    alive: dict[int, int] = {k: 0 for k in per_stage}
    peak_n = peak_b = 0
    for a in build_schedule(schedule, p, m, v).actions[rank]:
        if a.kind not in (F, free):
            continue
        alive[a.stage] += 1 if a.kind == F else -1
        peak_n = max(peak_n, sum(alive.values()))
        peak_b = max(peak_b, sum(n * per_stage[k] for k, n in alive.items()))
    return peak_n, peak_b


def pipeline_memory(
    model: nn.Module,
    *,
    pp: int,
    m: int,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    partition_method: str = "parameters",
    cut_points: list[int] | None = None,
    dp: int = 1,
    stage: int = 0,
    precision: str = "fp16",
    optimizer: str | int = "Adam",
    micro_batch_size: int = 1,
    seq_len: int | None = None,
    checkpointing: bool = False,
) -> list[StageMemory]:
    """Per pp rank memory of ``model`` cut into ``pp x virtual_stages`` stages (module
    docstring). ``model`` is best built on the meta device; ``seq_len`` defaults to the
    model's longest sequence (``max_seq_len`` / ``max_position_embeddings``)."""
    from meshtrain.parallel.pipeline.split import split_model

    positive_int("micro_batch_size", micro_batch_size)
    if seq_len is not None:
        positive_int("seq_len", seq_len)
    from meshtrain.parallel.pipeline.schedules import V_SHAPED, stage_rank

    v = virtual_stages if schedule == "interleaved_1f1b" else 2 if schedule in V_SHAPED else 1
    stages = split_model(model, pp * v, method=partition_method, cut_points=cut_points)
    dims = TransformerDims.of(model)
    out = []
    for r in range(pp):
        mine = {k: st for k, st in enumerate(stages) if stage_rank(schedule, k, pp) == r}
        params = {id(p): p for st in mine.values() for p in st.names.values()}
        trainable = sum(p.numel() for p in params.values() if p.requires_grad)
        frozen = sum(p.numel() for p in params.values() if not p.requires_grad)
        states = model_states_bytes(
            trainable,
            dp=dp,
            stage=stage,
            precision=precision,
            optimizer=optimizer,
            frozen_params=frozen,
        )
        peak_n, acts = rank_activations(
            mine, dims, schedule=schedule, pp=pp, m=m, v=v, rank=r, b=micro_batch_size,
            seq_len=seq_len, precision=precision, checkpointing=checkpointing,
        )  # fmt: skip
        blocks = sum(len(getattr(st, "block_ids", ())) for st in mine.values())
        out.append(StageMemory(r, tuple(mine), blocks, trainable, states, peak_n, acts))
    return out


def rank_activations(
    mine: dict,
    dims: TransformerDims | None,
    *,
    schedule: str,
    pp: int,
    m: int,
    v: int,
    rank: int,
    b: int,
    seq_len: int | None,
    precision: str,
    checkpointing: bool,
) -> tuple[int, int | None]:
    """(peak alive micro-batches, peak activation bytes or None) of pp rank ``rank``
    holding stages ``mine`` ({index: stage}; a split stage knows its ``block_ids``)."""
    s = seq_len or (dims.max_seq_len if dims else None)
    known = dims is not None and bool(s) and all(hasattr(st, "block_ids") for st in mine.values())
    width = 4 if str(precision).lower() == "fp32" else 2
    per_stage = {k: 0 for k in mine}
    if known:
        block = block_activation_bytes(dims, b, s, width, checkpointing)
        for k, st in mine.items():
            per_stage[k] = len(st.block_ids) * block
            if st.is_last:
                per_stage[k] += b * s * dims.vocab * (width + 4)
    peak_n, peak_b = peak_activations(schedule, pp, m, v, rank, per_stage)
    if not known:
        return peak_n, None
    if checkpointing:  # one block's full activations while it is recomputed
        peak_b += block_activation_bytes(dims, b, s, width)
    return peak_n, peak_b


def pipeline_table(rows: list[StageMemory], *, schedule: str, m: int, seq_len, b: int) -> str:
    """The per-rank table ``meshtrain estimate --pp P --model ...`` prints (GB = 1e9)."""
    from meshtrain.estimate.model_states import format_gb

    head = ["pp rank", "stages", "blocks", "params", "model states", "peak mb", "activations"]
    head.append("total")
    body = []
    for r in rows:
        acts = format_gb(r.activations) if r.activations is not None else "-"
        body.append(
            [
                str(r.rank),
                ",".join(map(str, r.stages)),
                str(r.blocks),
                f"{r.trainable:,}",
                format_gb(r.states.total),
                str(r.peak_micro_batches),
                acts,
                format_gb(r.total),
            ]
        )
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = [
        f"Per pipeline rank: schedule {schedule}, m={m} micro-batches of {b} x "
        f"{seq_len or '?'} tokens (peak mb: micro-batch activations alive at once)",
        "  ".join(c.rjust(w) for c, w in zip(head, widths, strict=True)),
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(x, widths, strict=True)) for x in body]
    return "\n".join(lines)

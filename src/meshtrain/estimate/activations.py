"""Activation memory per rank of a Llama-style decoder as a function of the sequence length
``L`` and the context-parallel size ``C``: what the forward keeps for the backward.

Counted tensor by tensor from what autograd saves in meshtrain's ``Decoder`` (and the same
layer shapes in transformers' Llama family), with a memory-efficient attention kernel
(SDPA flash/efficient: no ``[L, L]`` score matrix is kept, only a log-sum-exp per query
and head). Per block and token, hidden size ``h``, MLP size ``f``, ``a`` query heads,
key/value width ``kv = Hkv hd`` (``= h`` without grouped-query attention), activations of
``w`` bytes::

    norms       2 (4 h + 2 w h)     input as fp32, normalised before and after the weight
    attention   w (3 h + 2 kv)      q and k after rotary, v, the output, o_proj's input
    MLP         4 w f               gate, up, silu(gate), their product
    fp32 small  4 a + 8             attention log-sum-exp, the two norms' 1/rms

    block       8 h + w (7 h + 2 kv + 4 f) + 4 a + 8      (fp32, MHA: 4 (11 h + 4 f) + 4 a + 8)

and once per sequence: the final norm ``4 h + 2 w h + 4`` per token, the loss's fp32
log-probabilities ``4 V`` and int64 target ``8`` per predicted token (``s - 1`` of them),
the int64 token ids ``8`` per token, and with ``position_ids`` (packing, context parallelism) the gathered
rotary tables ``4 hd`` per token.

**Context parallelism.** Every rank holds ``s = L/C`` tokens outside attention, and the
all-to-all method keeps inside attention the whole sequence for ``1/C`` of the heads, the
same bytes; so the per-rank estimate is the formula at ``s = L/C`` and falls as ``1/C``
(under grouped-query attention with ``Hkv % C != 0`` the repeated key/value heads make
``kv`` per rank ``Hkv' hd`` with ``Hkv'`` from ``all_to_all.head_layout``). Ring attention
(``parallel/context/ring.py``) keeps its ``L/C`` queries, keys, values and output (the key/value
blocks of the other ranks go around the ring again in the backward instead of being kept),
so its attention term is ``w (3 h + 2 kv)`` per local token, the one-process term at ``L/C``
tokens: it falls as ``1/C`` too (an earlier ring kept all ``C`` blocks for its backward,
``2 w B L kv`` per layer whatever ``C``). **Document masks** (packed rows, ``document_ids``): under all-to-all the SDPA kernel keeps the
boolean mask as a ``w``-byte ``[B, 1, L, L]`` tensor per layer, built on every rank for the
whole sequence, so that term, ``w B L^2`` per layer, does not fall with ``C`` (measured
exact at cp 2 and 4); the ring keeps the blocks' int64 ids instead, at most ``8 B L`` per
layer (counted as ``8 B L``: the measured bytes are ``8 B L (1 - 1/2C)``).

Measured by ``tests/test_estimate_activations.py``: the formula equals the bytes of the
distinct storages autograd saves (``activation_probe.SavedBytes``) to within 0.1% on the
Decoder (fp32 and bf16, CPU), and at ``C = 2, 4`` with all-to-all attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshtrain.families.rooms import ROOMS

# which families the formula counts and where their configs keep its sizes: the rooms'
# (``Room.activation_types``, ``Room.config_names``), in room order, each set of names once
ACTIVATION_TYPES = frozenset(t for room in ROOMS for t in room.activation_types)
CONFIG_NAMES: tuple[tuple[str, ...], ...] = tuple(
    dict.fromkeys(r.config_names.in_order() for r in ROOMS if r.config_names is not None)
)

__all__ = [
    "ACTIVATION_TYPES",
    "CONFIG_NAMES",
    "DecoderDims",
    "activation_bytes",
    "activation_table",
    "attach_activations",
    "block_parts",
    "peak_activation_bytes",
]


@dataclass(frozen=True)
class DecoderDims:
    """The sizes the activation formula needs."""

    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    layers: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def of(cls, model: nn.Module) -> DecoderDims | None:
        """From meshtrain's ``Decoder`` or a transformers Llama-style config, else None."""
        cfg = getattr(model, "config", None)
        if cfg is None or getattr(cfg, "moe", None) is not None:  # MoE MLPs: not this formula
            return None
        model_type = getattr(cfg, "model_type", None)  # transformers: the Llama-style dense ones
        if model_type is not None and model_type not in ACTIVATION_TYPES:
            return None
        for keys in CONFIG_NAMES:
            vals = [getattr(cfg, k, None) for k in keys]
            if vals[2] is None:  # configs without grouped-query attention
                vals[2] = vals[1]
            if all(isinstance(x, int) for x in vals):
                return cls(*vals)
        return None


def activation_bytes(
    dims: DecoderDims,
    *,
    seq_len: int,
    cp: int = 1,
    batch: int = 1,
    width: int = 4,
    method: str = "all_to_all",
    position_ids: bool = False,
    documents: bool = False,
) -> int:
    """Activation bytes per rank for ``batch`` sequences of ``seq_len`` tokens over ``cp``
    context-parallel ranks (module docstring); ``width``: bytes per activation element."""
    if seq_len % cp:
        raise ValueError(f"seq_len {seq_len} is not divisible by cp {cp}")
    if method not in ("all_to_all", "ring"):
        raise ValueError(f"method {method!r}: use all_to_all or ring")
    s = seq_len // cp
    norms, attention, mlp, small = block_parts(dims, cp=cp, width=width, method=method)
    block = norms + attention + mlp + small
    h, w = dims.hidden, width
    per_token = dims.layers * block + (4 * h + 2 * w * h + 4) + 8
    if position_ids:
        per_token += 4 * dims.head_dim
    total = batch * (s * per_token + (s - 1) * (4 * dims.vocab + 8))
    if documents and method == "all_to_all":  # the dense mask, whole sequence, every rank
        total += dims.layers * batch * w * seq_len * seq_len
    elif documents:  # ring: the blocks' int64 document ids
        total += dims.layers * batch * 8 * seq_len
    return total


def block_parts(
    dims: DecoderDims, *, cp: int = 1, width: int = 4, method: str = "all_to_all"
) -> tuple[int, int, int, int]:
    """One block's bytes per local token, by part: ``(norms, attention, MLP, fp32 small)``
    (module docstring; their sum is the block term of ``activation_bytes``). The planner
    divides the attention and MLP parts by the tensor-parallel size (their activations
    are sharded by heads and columns) and the norms only under sequence parallelism."""
    h, w = dims.hidden, width
    kv = dims.kv_heads * dims.head_dim
    if method == "all_to_all" and cp > 1:
        from meshtrain.parallel.context.all_to_all import head_layout

        hq2, hkv2 = head_layout(dims.heads, dims.kv_heads, cp)
        kv, h_attn = hkv2 * dims.head_dim, hq2 * dims.head_dim
    else:
        h_attn = h
    norms = 2 * (4 * h + 2 * w * h)
    if method == "ring":  # q, out, o_proj input; its own key/value block
        attention = w * (3 * h + 2 * kv)
    else:  # q, out (the attention's heads), k, v; o_proj input
        attention = w * (2 * h_attn + 2 * kv + h)
    return norms, attention, 4 * w * dims.ffn, 4 * (h_attn // dims.head_dim) + 8


def peak_activation_bytes(dims: DecoderDims, *, seq_len: int, cp: int = 1, batch: int = 1,
                          **kw) -> int:  # fmt: skip
    """The most activation bytes alive at once in a forward + backward on one rank: what
    the forward keeps (``activation_bytes``, same keywords) plus the loss's two fp32
    ``[batch, L/C, V]`` gradients (log-probabilities and logits) alive together at the
    start of the backward, the largest transient while the vocabulary is larger than the
    MLP. Measured on the Decoder (fp32, CPU) at 8k and 16k tokens, cp 1, 2, 4: within 1%
    of the peak RSS growth of a step (``benchmarks/bench_context_parallel.py``)."""
    kept = activation_bytes(dims, seq_len=seq_len, cp=cp, batch=batch, **kw)
    return kept + 2 * 4 * batch * (seq_len // cp) * dims.vocab


def activation_table(
    dims: DecoderDims,
    seq_lens: list[int],
    cps: list[int],
    *,
    batch: int = 1,
    width: int = 2,
    method: str = "all_to_all",
) -> str:
    """Rows of sequence length (kept and peak), columns of cp size: activation GB per rank
    (GB = 1e9)."""
    from meshtrain.estimate.model_states import format_gb

    head = ["seq len", ""] + [f"cp={c}" for c in cps]
    body = []
    for length in seq_lens:
        for label, fn in (("kept", activation_bytes), ("peak", peak_activation_bytes)):
            row = [f"{length:,}", label]
            for c in cps:
                if length % (2 * c) and c > 1:
                    row.append("-")  # not a multiple of 2C: refused by context parallelism
                    continue
                kw = dict(batch=batch, width=width, method=method, position_ids=c > 1)
                row.append(format_gb(fn(dims, seq_len=length, cp=c, **kw)))
            body.append(row)
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = [
        f"Activation memory per rank ({method}, {batch} sequence(s) per micro-batch, "
        f"{width}-byte activations, no activation checkpointing; GB = 1e9; kept: saved for "
        "the backward; peak: with the loss's gradients at the start of the backward)",
        "  ".join(c.rjust(wd) for c, wd in zip(head, widths, strict=True)),
    ]
    lines += ["  ".join(c.rjust(wd) for c, wd in zip(x, widths, strict=True)) for x in body]
    return "\n".join(lines)


def attach_activations(log, model: nn.Module, topology, config, dtype) -> bool:
    """Give the engine's step log (``StepLog.set_activations``) this formula for ``model``
    on ``topology``'s cp size, with ``config.context_parallel.method`` where the config has
    it (else all-to-all). Attaches nothing (returns False) where the formula does not hold:
    unknown model sizes, tensor or pipeline parallelism, activation checkpointing (each
    changes what a rank keeps)."""
    dims = DecoderDims.of(model)
    split = topology.tp_size > 1 or topology.pp_size > 1
    if dims is None or split or config.activation_checkpointing.enabled:
        return False
    cp, width = topology.cp_size, 4 if dtype == torch.float32 else 2
    method = getattr(getattr(config, "context_parallel", None), "method", "all_to_all")

    def estimate(rows: int, tokens: int) -> int:  # tokens: this rank's, L / cp
        return activation_bytes(
            dims, seq_len=tokens * cp, cp=cp, batch=rows, width=width, method=method,
            position_ids=cp > 1,
        )  # fmt: skip

    log.set_activations(estimate)
    return True

"""The key/value cache of the sequences that decode together: a paged layout.

Layout. Every layer holds one flat store of key slots and one of value slots,
``[capacity * block_size, kv_heads, head_dim]``. A sequence owns whole **blocks** of
``block_size`` consecutive slots (default 16 tokens), listed in its **block table**:
its token at position ``p`` lives in slot ``table[p // block_size] * block_size +
p % block_size``, in every layer. Blocks come from one free list (:class:`BlockPool`); a
sequence takes a new block when its length crosses a block boundary, and gives all its
blocks back when it ends. So the memory held is ``ceil(n / block_size)`` blocks per
live sequence of ``n`` tokens (at most ``block_size - 1`` slots wasted per sequence),
never the padding of a rectangular batch, and a finished sequence frees its memory at
once, with no copy of anybody else's cache. The stores start small and double when the
live blocks need more (up to ``max_blocks``), so what is allocated follows the peak of
live tokens, not the worst case.

One forward for everybody. A step's new tokens of every sequence -- one token per
decoding sequence, and a chunk of prompt for each sequence being prefilled -- are laid
end to end in a single row ``[1, N]`` with their own positions (``position_ids``), and
the model runs once. Its attention layers call :func:`paged_attention` (registered with
``transformers``' ``AttentionInterface`` under the name ``meshtrain_paged``, switched on
only for these forwards), which, per layer:

1. writes the ``N`` new keys and values into their slots (one ``index_copy_``);
2. for the decoding sequences, gathers each one's whole blocks (one ``index_select`` of
   ``B x blocks`` rows of ``block_size`` contiguous slots, not one index per token) into
   ``[B, kv_heads, T, dim]`` (``T`` the longest table's blocks times ``block_size``; the
   slots past each sequence's length get ``-inf`` in an additive mask) and runs one
   ``scaled_dot_product_attention`` of their ``B`` single queries, each kv head's group of
   query heads folded into the query length (``[B, kv_heads, group, dim]``: no
   ``enable_gqa`` expansion, and the CPU kernel then works on ``group`` rows at once);
3. for each prefill chunk attends causally: a sequence's first chunk to the step's own
   keys and values (no gather), a later chunk of a long prompt to its sequence's slots
   (gathered: it sees its own earlier tokens and the chunk so far).

So the Python work of a step is the model's own plus O(number of prefill chunks): no
per-token loops. Reads are gathers, so memory traffic is that of the live tokens.

What can run paged: models whose attention goes through ``transformers``' attention
interface with plain full causal attention (Llama, Qwen2, Mistral without a sliding
window shorter than the context, GPT-2, ...). A softcap, attention sinks or a sliding
window shorter than the context raise :class:`PagedUnsupported`; the server probes the
model at start-up (logits of a chunked prefill and a decode step against a plain
forward) and otherwise serves one request at a time with ``model.generate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

ATTN_NAME = "meshtrain_paged"


class PagedUnsupported(RuntimeError):
    """The model's attention asks for something the paged kernel does not do."""


class BlockPool:
    """Blocks of ``block_size`` key/value slots for every layer, and their free list.

    ``keys[layer]`` and ``values[layer]`` are ``[capacity * block_size, kv_heads,
    head_dim]``, created at the first write (the shapes come from the model's keys).
    ``capacity`` doubles on demand up to ``max_blocks``; ``in_use`` is the number of
    blocks that sequences hold."""

    def __init__(self, block_size: int = 16, max_blocks: int = 1024, initial: int = 64) -> None:
        if block_size < 1 or max_blocks < 1:
            raise ValueError(f"block_size {block_size} and max_blocks {max_blocks} must be >= 1")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.capacity = min(initial, max_blocks)
        self.free: list[int] = list(range(self.capacity - 1, -1, -1))  # pop() takes block 0 first
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    @property
    def in_use(self) -> int:
        return self.capacity - len(self.free)

    @property
    def available(self) -> int:
        """Blocks that can still be handed out (free now, or by growing)."""
        return len(self.free) + self.max_blocks - self.capacity

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > self.available:
            raise RuntimeError(f"{n} key/value blocks asked, {self.available} available")
        while len(self.free) < n:
            self._grow()
        return [self.free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))

    def _grow(self) -> None:
        new = min(2 * self.capacity, self.max_blocks)
        extra = (new - self.capacity) * self.block_size
        for store in (self.keys, self.values):
            for layer, t in store.items():
                store[layer] = torch.cat([t, t.new_zeros(extra, *t.shape[1:])])
        self.free = list(range(new - 1, self.capacity - 1, -1)) + self.free
        self.capacity = new

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` (``[N, kv_heads, dim]``) in ``slots`` of ``layer``."""
        if layer not in self.keys:
            size = self.capacity * self.block_size
            self.keys[layer] = k.new_zeros(size, *k.shape[1:])
            self.values[layer] = v.new_zeros(size, *v.shape[1:])
        self.keys[layer].index_copy_(0, slots, k)
        self.values[layer].index_copy_(0, slots, v)


@dataclass
class PagedSeq:
    """One sequence's place in the pool: its block table and cached length."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose keys and values are stored


@dataclass
class StepPlan:
    """What every layer of one forward needs (built once per step; module docstring).

    ``slots[N]``: where each new token's key and value go. The first ``decoding`` tokens
    of the row are decoding sequences: ``decode_blocks[B * nb]`` their block tables
    (each padded to ``nb`` blocks with block 0), ``decode_valid[B, 1, 1, nb * block_size]``
    which gathered slots are real; ``decode_bias`` is that mask as ``0`` / ``-inf`` in the
    query's dtype, made by the first layer and shared by the others. ``chunks``: per
    prefill chunk (start in the row, length, then its sequence's slots so far and the
    causal mask over them; both None for a sequence's first chunk, which attends to the
    step's own keys and values with ``is_causal``)."""

    pool: BlockPool
    slots: torch.Tensor
    decoding: int
    decode_blocks: torch.Tensor | None
    decode_valid: torch.Tensor | None
    chunks: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]
    context: int | None = None  # the served context (a shorter sliding window is refused)
    decode_bias: torch.Tensor | None = None

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        if self.decode_bias is None or self.decode_bias.dtype != dtype:
            zero = torch.zeros((), dtype=dtype, device=self.decode_valid.device)
            self.decode_bias = zero.masked_fill(~self.decode_valid, float("-inf"))
        return self.decode_bias


def plan_step(
    pool: BlockPool,
    decoding: list[PagedSeq],
    chunks: list[tuple[PagedSeq, int]],
    device: torch.device,
    context: int | None = None,
) -> StepPlan:
    """Take blocks for this step's tokens and build its :class:`StepPlan`.

    ``decoding``: sequences that add one token; ``chunks``: (sequence, tokens) prefill
    pieces. Row order: the decoding tokens first, then each chunk. Lengths are advanced
    here: the forward that follows stores exactly these tokens. Python work is O(number
    of sequences + chunk tokens) on small ints, in one pass per sequence; the tensors are
    made in one call each. A chunk that starts its sequence (nothing cached yet) needs
    no gather and no mask: it attends to its own keys, causally."""
    bs = pool.block_size
    slots: list[int] = []
    decode_blocks = decode_valid = None
    if decoding:
        lengths: list[int] = []
        for s in decoding:
            pos = s.length
            if (pos + bs) // bs > len(s.blocks):  # its next token opens a new block
                s.blocks += pool.allocate(1)
            slots.append(s.blocks[pos // bs] * bs + pos % bs)
            s.length = pos + 1
            lengths.append(pos + 1)
        nb = max(len(s.blocks) for s in decoding)
        decode_blocks = torch.tensor(
            [b for s in decoding for b in s.blocks + [0] * (nb - len(s.blocks))], device=device
        )
        valid = torch.arange(nb * bs, device=device) < torch.tensor(lengths, device=device)[:, None]
        decode_valid = valid[:, None, None]
    planned = []
    start = len(decoding)
    for seq, n in chunks:
        past = seq.length
        need = -(-(past + n) // bs) - len(seq.blocks)
        if need > 0:
            seq.blocks += pool.allocate(need)
        first, last = past // bs, (past + n - 1) // bs
        mine = [b * bs + i for b in seq.blocks[first : last + 1] for i in range(bs)]
        slots += mine[past - first * bs : past - first * bs + n]
        kv = mask = None
        if past:  # query i (position past + i) sees keys 0 .. past + i, gathered
            kv = torch.tensor(
                [b * bs + i for b in seq.blocks[: last + 1] for i in range(bs)][: past + n],
                device=device,
            )
            q = torch.arange(n)[:, None] + past
            mask = (torch.arange(past + n)[None, :] <= q).to(device)
        planned.append((start, n, kv, mask))
        start += n
        seq.length = past + n
    return StepPlan(
        pool,
        torch.tensor(slots, device=device),
        len(decoding),
        decode_blocks,
        decode_valid,
        planned,
        context,
    )


def paged_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``transformers`` attention function over the paged cache (module docstring).

    ``query`` is ``[1, heads, N, dim]``, ``key``/``value`` ``[1, kv_heads, N, dim]`` for
    the step's ``N`` new tokens; ``kwargs["meshtrain_plan"]`` is the :class:`StepPlan`.
    Returns ``[1, N, heads, dim]`` as ``transformers``' attention functions do."""
    plan: StepPlan | None = kwargs.get("meshtrain_plan")
    if plan is None:
        raise PagedUnsupported("paged attention called without a step plan")
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise PagedUnsupported(f"the model's attention uses {name}")
    window = kwargs.get("sliding_window")
    if window is not None and (plan.context is None or window < plan.context):
        raise PagedUnsupported(f"the model's attention has a sliding window of {window}")
    layer = module.layer_idx
    pool = plan.pool
    pool.write(layer, plan.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
    keys, values = pool.keys[layer], pool.values[layer]
    gqa = query.shape[1] != key.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    b = plan.decoding
    if b:
        heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[3]
        bs = pool.block_size
        # whole blocks, one index_select per store: [B, nb * bs, kv_heads, dim]
        k = keys.view(-1, bs, kv_heads, dim).index_select(0, plan.decode_blocks)
        v = values.view(-1, bs, kv_heads, dim).index_select(0, plan.decode_blocks)
        k = k.view(b, -1, kv_heads, dim).transpose(1, 2)  # [B, kv_heads, T, dim]
        v = v.view(b, -1, kv_heads, dim).transpose(1, 2)
        # query head h reads kv head h // group (repeat_kv's order): the group's queries
        # become the query length of their kv head
        q = query[0, :, :b].transpose(0, 1).reshape(b, kv_heads, heads // kv_heads, dim)
        o = sdpa(q, k, v, attn_mask=plan.bias(query.dtype), scale=scaling)
        o = o.reshape(b, heads, dim)
        if not plan.chunks:  # a decoding-only step: [B, heads, dim] is the whole answer
            return o[None], None  # [1, B, heads, dim]
    out = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
    if b:
        out[0, :b] = o
    for start, n, kv, mask in plan.chunks:
        q = query[:, :, start : start + n]
        if kv is None:  # the sequence's first chunk: its keys are this step's own
            k, v = key[:, :, start : start + n], value[:, :, start : start + n]
        else:  # [1, kv_heads, past + n, dim] gathered from its slots
            k = keys.index_select(0, kv).transpose(0, 1).unsqueeze(0)
            v = values.index_select(0, kv).transpose(0, 1).unsqueeze(0)
        o = sdpa(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=gqa)
        out[0, start : start + n] = o[0].transpose(0, 1)
    return out, None


def register() -> None:
    """Make :func:`paged_attention` known to ``transformers`` as ``meshtrain_paged``
    (idempotent: the same function under the same name)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)

"""The runs docs/plan.md's tables measure: the models (small for the training tables,
150-240 MB for host RAM while loading) and the layouts of each table, as
``(family, model config, Layout)`` rows (``measure.build_model``'s configs)."""

from __future__ import annotations

from meshtrain.plan.layout import Layout

__all__ = [
    "BIG_DECODER", "BIG_LLAMA", "BIG_MIXTRAL", "DECODER", "LLAMA", "LOADED", "MEASURED",
    "MIXTRAL", "PACKED", "PACKED_SEQ", "SEQ", "SLICED", "ZERO_INIT",
]  # fmt: skip

DECODER = dict(vocab_size=4224, dim=256, n_layers=4, n_heads=4, ffn_dim=688, max_seq_len=256)
LLAMA = dict(hf="llama", vocab_size=2048, hidden_size=256, intermediate_size=688,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
MIXTRAL = dict(hf="mixtral", vocab_size=2048, hidden_size=128, intermediate_size=256,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
               tie_word_embeddings=False)  # fmt: skip
SEQ = 256

L = Layout
MEASURED: tuple[tuple[str, dict, Layout], ...] = (
    ("decoder", DECODER, L(dp=1, micro_batch=2)),
    ("decoder", DECODER, L(dp=1, micro_batch=4)),
    ("decoder", DECODER, L(dp=1, micro_batch=4, checkpointing=True)),
    ("decoder", DECODER, L(dp=1, micro_batch=2, grad_accum=2)),
    ("decoder", DECODER, L(dp=2, stage=0, micro_batch=2)),
    ("decoder", DECODER, L(dp=2, stage=1, micro_batch=2)),
    ("decoder", DECODER, L(dp=2, stage=2, micro_batch=2)),
    ("decoder", DECODER, L(dp=2, stage=3, micro_batch=2)),
    ("decoder", DECODER, L(dp=2, stage=2, micro_batch=2, checkpointing=True)),
    ("decoder", DECODER, L(dp=1, tp=2, micro_batch=2)),
    ("decoder", DECODER, L(dp=1, tp=2, sequence_parallel=True, micro_batch=2)),
    ("decoder", DECODER, L(dp=1, pp=2, micro_batch=1, grad_accum=4)),
    ("decoder", DECODER, L(dp=1, pp=2, schedule="gpipe", micro_batch=1, grad_accum=4)),
    ("decoder", DECODER, L(dp=1, cp=2, cp_method="ring", micro_batch=2)),
    ("decoder", DECODER, L(dp=1, cp=2, cp_method="all_to_all", micro_batch=2)),
    ("decoder", DECODER, L(dp=4, stage=2, micro_batch=1)),
    ("decoder", DECODER, L(dp=2, tp=2, stage=1, micro_batch=1)),
    ("decoder", DECODER, L(dp=2, pp=2, stage=1, micro_batch=1, grad_accum=2)),
    ("llama", LLAMA, L(dp=1, micro_batch=2)),
    ("llama", LLAMA, L(dp=2, stage=3, micro_batch=2)),
    ("llama", LLAMA, L(dp=1, tp=2, micro_batch=2)),
    ("mixtral", MIXTRAL, L(dp=1, micro_batch=2)),
    ("mixtral", MIXTRAL, L(dp=2, ep=2, stage=1, micro_batch=2)),
)


# Host RAM while loading (plan.host_memory): models of 150-240 MB, so that the tensors and not
# the interpreter decide the peak (the training table's models are ~20 MB).
BIG_DECODER = dict(DECODER, dim=1024, n_layers=8)
BIG_LLAMA = dict(LLAMA, vocab_size=8192, hidden_size=768, intermediate_size=2048,
                 num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=4)  # fmt: skip
BIG_MIXTRAL = dict(MIXTRAL, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                   num_local_experts=8, num_attention_heads=8, num_key_value_heads=4)  # fmt: skip
LOADED: tuple[tuple[str, dict, Layout], ...] = (
    ("decoder", BIG_DECODER, L(dp=1, micro_batch=2)),
    ("decoder", BIG_DECODER, L(dp=2, stage=1, micro_batch=2)),
    ("decoder", BIG_DECODER, L(dp=2, stage=3, micro_batch=2)),
    ("decoder", BIG_DECODER, L(dp=4, stage=3, micro_batch=1)),
    ("decoder", BIG_DECODER, L(dp=1, tp=2, micro_batch=2)),
    ("decoder", BIG_DECODER, L(dp=1, pp=2, micro_batch=1, grad_accum=2)),
    ("decoder", BIG_DECODER, L(dp=2, tp=2, stage=1, micro_batch=1)),
    ("decoder", BIG_DECODER, L(dp=1, cp=2, micro_batch=2)),
    ("llama", BIG_LLAMA, L(dp=1, micro_batch=2)),
    ("llama", BIG_LLAMA, L(dp=2, stage=3, micro_batch=2)),
    ("llama", BIG_LLAMA, L(dp=1, tp=2, micro_batch=2)),
    ("mixtral", BIG_MIXTRAL, L(dp=1, micro_batch=2)),
    ("mixtral", BIG_MIXTRAL, L(dp=2, ep=2, stage=1, micro_batch=2)),
    ("mixtral", BIG_MIXTRAL, L(dp=2, stage=3, micro_batch=2)),
)
# the same models loaded sliced (meshtrain.from_pretrained(folder, config=...))
SLICED: tuple[tuple[str, dict, Layout], ...] = (
    ("llama", BIG_LLAMA, L(dp=1, micro_batch=2)),
    ("llama", BIG_LLAMA, L(dp=2, stage=3, micro_batch=2)),
    ("llama", BIG_LLAMA, L(dp=4, stage=3, micro_batch=1)),
    ("llama", BIG_LLAMA, L(dp=1, tp=2, micro_batch=2)),
    ("llama", BIG_LLAMA, L(dp=1, pp=2, micro_batch=1, grad_accum=2)),
    ("mixtral", BIG_MIXTRAL, L(dp=2, ep=2, stage=1, micro_batch=2)),
    ("mixtral", BIG_MIXTRAL, L(dp=2, stage=3, micro_batch=2)),
)
# the reference decoder built under meshtrain.zero.Init (ZeRO-3)
ZERO_INIT: tuple[tuple[str, dict, Layout], ...] = (
    ("decoder", BIG_DECODER, L(dp=2, stage=3, micro_batch=2)),
    ("decoder", BIG_DECODER, L(dp=4, stage=3, micro_batch=1)),
)


# Packed rows (plan.memory.packed_masks) at sequence 1,024, where the masks are large enough
# to see (at 256 they are ~1% of the peak).
PACKED_SEQ = 1024
PACKED: tuple[tuple[str, dict, Layout], ...] = (
    ("decoder", dict(DECODER, max_seq_len=PACKED_SEQ), L(dp=1, micro_batch=2)),
    ("decoder", dict(DECODER, max_seq_len=PACKED_SEQ), L(dp=1, micro_batch=2, packed=True)),
    ("decoder", dict(DECODER, max_seq_len=PACKED_SEQ),
     L(dp=1, micro_batch=2, packed=True, checkpointing=True)),
    ("decoder", dict(DECODER, max_seq_len=PACKED_SEQ), L(dp=2, stage=1, micro_batch=2, packed=True)),
    ("decoder", dict(DECODER, max_seq_len=PACKED_SEQ), L(dp=1, tp=2, micro_batch=2, packed=True)),
    ("decoder", dict(DECODER, max_seq_len=PACKED_SEQ),
     L(dp=1, cp=2, cp_method="all_to_all", micro_batch=2, packed=True)),
    ("decoder", dict(DECODER, max_seq_len=PACKED_SEQ), L(dp=1, cp=2, micro_batch=2, packed=True)),
    ("llama", dict(LLAMA, max_position_embeddings=PACKED_SEQ), L(dp=1, micro_batch=2, packed=True)),
)  # fmt: skip

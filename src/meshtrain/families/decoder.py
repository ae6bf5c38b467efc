"""The room of meshtrain's reference decoder (``meshtrain.models.Decoder``), its MoE form
(``model.moe``) included.

Named by string (``meshtrain.models.decoder.Decoder``), never imported: this package sits
below ``parallel/``, and ``models/`` above it. Its experts are ``parallel.experts``'
own ``RoutedExperts``, which expert parallelism knows without a room.
"""

from __future__ import annotations

from meshtrain.families.block_plan import BlockPlan
from meshtrain.families.config_names import ConfigNames
from meshtrain.families.layout import Layout
from meshtrain.families.room import Room
from meshtrain.families.tp_plan import TPPlan

DECODER = TPPlan(
    name="meshtrain decoder",
    classes=("Decoder",),
    sizes={"heads": "config.n_heads", "vocab": "config.vocab_size"},
    rows=(
        ("embed", "embedding_to_sequence", "vocab"),
        ("layers.*.attn_norm", "sequence"),
        ("layers.*.attn", "region"),
        ("layers.*.attn.q_proj", "column", "heads"),
        ("layers.*.attn.k_proj", "column", "heads"),
        ("layers.*.attn.v_proj", "column", "heads"),
        ("layers.*.attn.o_proj", "row", "heads"),
        ("layers.*.mlp_norm", "sequence"),
        ("layers.*.mlp", "region"),
        ("layers.*.mlp.gate_proj", "column"),
        ("layers.*.mlp.up_proj", "column"),
        ("layers.*.mlp.down_proj", "row"),
        ("norm", "sequence"),
        ("lm_head", "lm_head", "vocab"),
    ),
    attrs=(("layers.*.attn", "n_heads", "heads"),),
    loss="decoder",
)

ROOM = Room(
    name="meshtrain decoder",
    classes=("meshtrain.models.decoder.Decoder",),
    tp_plans=(DECODER,),
    tp_blocks=(
        BlockPlan(
            ("meshtrain.models.decoder.Block",), DECODER, "layers.*", {"heads": "attn.n_heads"}
        ),
    ),
    layout=Layout("layers", {"embed": "input"}, ("norm", "lm_head")),
    # the seam (components.attention) reads each Attention's ``context``
    context_attention=("meshtrain.models.decoder.Attention",),
    config_names=ConfigNames("dim", "n_heads", "n_heads", "ffn_dim", "vocab_size", "n_layers"),
)

__all__ = ["DECODER", "ROOM"]

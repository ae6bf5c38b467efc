"""Top-k routing's old address: it is mesh-free and lives in
``meshtrain.components.routing`` (the Decoder's MoE layer imports it from there); imports
of this path keep working."""

from meshtrain.components.routing import ROUTINGS, check_routing, route, update_expert_bias

__all__ = ["ROUTINGS", "check_routing", "route", "update_expert_bias"]

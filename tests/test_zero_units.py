"""Stage-3 gather units and class-name matching (no processes needed)."""

from __future__ import annotations

import pytest
from torch import nn

from meshtrain.errors import ConfigError
from meshtrain.models import Decoder, DecoderConfig
from meshtrain.parallel.blocks import gather_units as find_units
from meshtrain.parallel.blocks import modules_of_classes
from meshtrain.parallel.zero.stage3 import assign_units

TINY = DecoderConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=16)


def names(modules):
    return [type(m).__name__ for m in modules]


def test_default_units_follow_the_module_list_and_the_children_on_the_way():
    assert names(find_units(Decoder(TINY))) == ["Embedding", "Block", "Block", "RMSNorm", "Linear"]
    body = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    assert names(find_units(body)) == ["Linear", "Linear"]  # no parameterless units
    assert find_units(nn.Linear(3, 4))[0].__class__ is nn.Linear  # no children: the model


def test_unit_classes_take_the_outermost_match_and_name_the_unknown_ones():
    model = Decoder(TINY)
    assert names(find_units(model, ["Block", "Attention"])) == ["Block", "Block"]
    assert names(modules_of_classes(model, ["Attention"], "f")) == ["Attention", "Attention"]
    with pytest.raises(ConfigError, match=r"stage3_module_classes: \['Nope'\] not found"):
        find_units(model, ["Nope"])


def test_small_and_tied_parameters():
    model = Decoder(TINY)
    units = find_units(model)
    owner = assign_units(model, units, threshold=33)  # the 32-element norms stay whole
    assert all(p.numel() >= 33 for p in owner)
    assert not any(n.endswith("norm.weight") for n, p in model.named_parameters() if p in owner)
    tied = Decoder(DecoderConfig(**{**TINY.__dict__, "tie_embeddings": True}))
    owner = assign_units(tied, find_units(tied), threshold=0)
    assert owner[tied.lm_head.weight] == 0  # owned by the embedding, the first user

"""transformers' ``optim`` names map to meshtrain optimizer types with transformers' settings."""

from __future__ import annotations

import pytest

from meshtrain.errors import ConfigError
from meshtrain.trainer import TrainingArguments


@pytest.mark.parametrize(
    ("optim", "kind", "keys"),
    [
        ("adafactor", "Adafactor", {"lr", "weight_decay"}),
        ("adamw_bnb_8bit", "AdamW8bit", {"lr", "weight_decay", "betas", "eps"}),
        ("adamw_8bit", "AdamW8bit", {"lr", "weight_decay", "betas", "eps"}),
        ("lion_32bit", "Lion", {"lr", "weight_decay", "betas"}),
        ("lion_8bit", "Lion8bit", {"lr", "weight_decay", "betas"}),
    ],
)
def test_transformers_names(optim, kind, keys, tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), optim=optim, adam_beta2=0.95)
    section = args.to_engine_config()["optimizer"]
    assert section["type"] == kind
    assert keys <= set(section["params"])
    if "betas" in keys:  # transformers hands Adam's betas to Lion too
        assert list(section["params"]["betas"]) == [0.9, 0.95]


def test_unsupported_name_lists_the_accepted_ones(tmp_path):
    with pytest.raises(
        ConfigError, match="TrainingArguments.optim: 'paged_adamw_8bit'.*adamw_8bit"
    ):
        TrainingArguments(output_dir=str(tmp_path), optim="paged_adamw_8bit")

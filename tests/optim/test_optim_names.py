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


@pytest.mark.parametrize(("optim", "fused"), [("adamw_torch_fused", True), ("adamw_torch", False)])
def test_adamw_torch_fused_is_torchs_fused_kernel_on_cpu_too(optim, fused, tmp_path):
    """transformers' ``adamw_torch_fused`` (its default) passes ``fused=True`` to torch's
    AdamW on any device, CPU included; ``adamw_torch`` passes nothing (torch's default, the
    single-tensor loop on CPU). The built optimizer steps bit-identically to that torch
    AdamW (the same kernel on the same tensors)."""
    import torch

    from meshtrain.optim.optimizers import build_optimizer

    args = TrainingArguments(output_dir=str(tmp_path), optim=optim, weight_decay=0.1)
    section = args.to_engine_config()["optimizer"]
    assert section["params"].get("fused", False) is fused
    torch.manual_seed(0)
    start = torch.randn(1000)
    ours, ref = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt = build_optimizer(section["type"], section["params"], [{"params": [ours]}])
    assert bool(opt.param_groups[0].get("fused")) is fused
    torch_opt = torch.optim.AdamW(
        [ref], lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
        **({"fused": True} if fused else {}),
    )  # fmt: skip
    for step in range(5):
        grad = torch.randn(1000, generator=torch.Generator().manual_seed(step))
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        torch_opt.step()
    assert torch.equal(ours, ref)

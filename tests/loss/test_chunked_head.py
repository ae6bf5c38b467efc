"""``"loss": {"chunked": true}`` through the engine equals the plain loss.

Each layout runs 3 AdamW steps twice, with and without ``loss.chunked`` (chunks of 5
tokens, so every batch is several chunks and an uneven last one), and compares losses
and the trained weights (normwise over the model) within ``trajectory(1e-2, 3)`` = 1.9e-5
relative (``tests/tolerance.py``: the chunked head sums the same products in another
order, and Adam at lr 1e-2 moves the weights by three updates; the Llama takes one step,
``trajectory(1e-2, 1)`` = 7.6e-6; measured across kernels and thread counts: at most
1.37e-6, the Llama at ``MKL_CBWR=COMPATIBLE``). The Llama's logits after its step,
normwise, within ``composed``: 16 linear maps whose weights each agree to that bound. Layouts: meshtrain's Decoder on 2 ranks under ZeRO-3, the
same Decoder with tensor parallelism 2 (vocab-parallel chunked loss), and a transformers
Llama with ``num_items_in_batch`` given and without labels (the head then returns real
logits). Pipeline parallelism and sequence parallelism are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.training import global_batch, make_model, max_rel_diff
from tests.harness import run_ranks
from tests.tolerance import check, composed, trajectory

STEPS = 3
LR = 1e-2
TOL = trajectory(LR, STEPS)  # the Decoder's 3 steps; the Llama takes 1 (below)


def _decoder(config_extra: dict) -> tuple[list[float], dict]:
    import torch.distributed as dist

    import meshtrain

    torch.manual_seed(0)
    model = make_model("decoder")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "steps_per_print": 1000,
        **config_extra,
    }
    engine, *_ = meshtrain.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    dp, r = engine.topology.dp_size, engine.topology.dp_rank
    losses = []
    for step in range(STEPS):
        x, y = global_batch("decoder", step, 2 * dp)
        loss = engine(x[2 * r : 2 * r + 2], y[2 * r : 2 * r + 2])
        engine.backward(loss)
        engine.step()
        t = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(float(t) / dist.get_world_size())
    return losses, engine.module_state_dict()


def _llama() -> dict:
    import meshtrain
    from tests.tiny_models import tiny_llama

    out = {}
    for chunked in (False, True):
        model = tiny_llama(0)
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "steps_per_print": 1000,
            "loss": {"chunked": chunked, "chunk_size": 5},
        }
        engine, *_ = meshtrain.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        labels = ids.clone()
        labels[0, :3] = -100
        loss = engine(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(20)).loss
        engine.backward(loss)
        engine.step()
        with torch.no_grad():
            logits = engine(input_ids=ids).logits
        out[chunked] = (loss.item(), engine.module_state_dict(), logits)
    return out


def _all() -> dict:
    from meshtrain.errors import ConfigError

    chunk = {"loss": {"chunked": True, "chunk_size": 5}}
    z3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    tp = {"mesh": {"tensor_parallel_size": 2}}
    out = {
        "zero3": (_decoder(z3), _decoder({**z3, **chunk})),
        "tp": (_decoder(tp), _decoder({**tp, **chunk})),
        "llama": _llama(),
    }
    refused = []
    for bad in (
        {"mesh": {"pipeline_parallel_size": 2}},
        {**tp, "tensor_parallel": {"sequence_parallel": True}},
    ):
        try:
            _decoder({**bad, **chunk})
            refused.append("not refused")
        except ConfigError as err:
            refused.append(str(err))
    out["refused"] = refused
    return out


def test_chunked_loss_through_the_engine():
    got = run_ranks(_all, 2)[0]
    for layout in ("zero3", "tp"):
        (plain_losses, plain_state), (losses, state) = got[layout]
        for step, (a, b) in enumerate(zip(losses, plain_losses, strict=True)):
            check(f"{layout} loss at step {step}", abs(a - b) / abs(b), TOL)
        check(f"{layout} params", max_rel_diff(state, plain_state), TOL)
    plain, chunked = got["llama"][False], got["llama"][True]
    one_step = trajectory(LR, 1)
    check("llama loss", abs(chunked[0] - plain[0]) / abs(plain[0]), one_step)
    check("llama params", max_rel_diff(chunked[1], plain[1]), one_step)
    # no labels: the head gives real logits (vocabulary-sized), from weights that agree
    # to one_step; through the Llama's 2 x 7 block matrices, the embedding and the head
    assert chunked[2].shape == plain[2].shape == (2, 8, 64)
    logits_diff = float((chunked[2] - plain[2]).norm() / plain[2].norm())
    check("llama logits", logits_diff, composed(one_step, 16))
    assert all(m.startswith("loss.chunked") for m in got["refused"]), got["refused"]


@pytest.mark.parametrize("bad", [{"chunk_size": 0}, {"chunked": "yes"}])
def test_bad_loss_section_is_named(bad):
    from meshtrain.config import load_config
    from meshtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="loss."):
        load_config({"train_micro_batch_size_per_gpu": 1, "loss": bad})

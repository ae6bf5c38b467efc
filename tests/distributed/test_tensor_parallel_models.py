"""Whole tiny models under tensor parallelism vs one process, at tp 2 and tp 4 (gloo).

Covered per world size in one spawn, each with and without sequence parallelism: the
reference decoder, tiny transformers Llama (GQA; at tp 3 its 4 key/value heads and 8
query heads are padded to 6 and 12), GPT-2 (fused q|k|v Conv1D, tied LM head) and BERT
(sequence classification, token classification, and masked LM with the vocab-parallel
loss, its decoder tied to the word embeddings):

* forward loss within ``evaluation()`` relative of the same model in one process, and the
  gradients gathered back from the shards within ``gradient()`` normwise over the whole
  model (``tests/tolerance.py``; fp32: only the order of additions differs, ~1e-7
  observed);
* each rank holds 1/T of every (padded) sharded weight, and exactly the parameter count
  ``parallel.tensor.sizes.local_parameter_counts`` (the estimator's) predicts;
* ``full_state_dict`` returns the original keys, shapes and values (exactly: sharding
  and gathering only move data);
* ``remove_tensor_parallel`` gives back the model as built (module types, tied
  parameters, no hook left, attributes such as head counts and the loss function
  restored), with the original values exactly, computing the one-process loss exactly;
* exact collective calls and bytes for one decoder block, forward and backward, as in
  the table of ``meshtrain.parallel.tensor.apply``;
* dropout: different masks across tp ranks inside regions, identical outside; under
  sequence parallelism the dropouts that run on a sequence shard (GPT-2's embedding and
  residual dropout) draw different masks on each tp rank too, while the default random
  stream stays identical on every rank (so replicated dropout stays in sync);
* greedy ``generate()`` on Llama and GPT-2 gives the tokens one process gives (the LM head gathers
  its vocabulary shards while it runs); under sequence parallelism it is refused;
* the errors: no plan, two rows replacing one module, sequence parallel on a plan that
  does not support it.
"""

from __future__ import annotations

import pytest

from tests.harness import run_ranks
from tests.tolerance import check, evaluation, gradient

KINDS = ("decoder", "llama", "gpt2", "bert", "bert_tokens", "bert_mlm")
CASES = [(kind, sp) for kind in KINDS for sp in (False, True)]


def _parity(world: int) -> dict:
    import torch

    from meshtrain.distributed.topology import Topology
    from meshtrain.parallel.tensor import apply_tensor_parallel, full_state_dict, tp_specs
    from meshtrain.parallel.tensor.sharding import unshard_tensor
    from meshtrain.parallel.tensor.sizes import local_parameter_counts
    from tests.distributed.tp_models import batch, build, loss_of

    topo = Topology(tp=world)
    g = topo.tp_group
    out: dict = {}
    # tp 3 is about padding: Llama's grouped-query heads, the decoder's vocabulary
    for kind, sp in CASES if world != 3 else [c for c in CASES if c[0] in ("llama", "decoder")]:
        ref = build(kind)
        inputs = batch(kind, seq=9 if world == 3 else 8)  # sequence parallel: T | seq
        ref_loss = loss_of(ref, kind, inputs)
        ref_loss.backward()
        model = build(kind)
        full0 = {k: v.clone() for k, v in model.state_dict().items()}
        predicted = local_parameter_counts(model, world)[0]
        apply_tensor_parallel(model, topo, sequence_parallel=sp)
        held = sum({id(p): p.numel() for p in model.parameters()}.values())
        loss = loss_of(model, kind, inputs)
        loss.backward()
        specs = tp_specs(model)
        ref_params = dict(ref.named_parameters())
        num = den = 0.0
        sizes_ok = True
        for name, p in model.named_parameters():
            spec = specs.get(name)
            grad = p.grad if spec is None else unshard_tensor(p.grad, spec, g)
            num += float((grad - ref_params[name].grad).pow(2).sum())
            den += float(ref_params[name].grad.pow(2).sum())
            if spec is not None:
                padded = spec.blocks * spec.padded_units * spec.unit
                sizes_ok &= p.shape[spec.dim] * world == padded and p.shape[spec.dim] == spec.local
        state = full_state_dict(model, g)
        out[kind, sp] = {
            "loss": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
            "grad": (num / den) ** 0.5,
            "sizes": sizes_ok,
            "count": (predicted, held),
            "n_sharded": len([n for n in specs if n in dict(model.named_parameters())]),
            "state_keys": sorted(state) == sorted(full0),
            "state_equal": all(torch.equal(state[k], full0[k]) for k in full0),
            "restored": _restored(model, ref, full0, kind, inputs, ref_loss, g),
        }
    if world == 3:
        return out  # padding parity only: the checks below ran at tp 2 and 4
    out["block"] = _block_counts(topo)
    out["dropout"] = _dropout(topo)
    out["errors"] = _errors(topo)
    out["generate"] = _generate(topo)
    return out


def _restored(model, ref, full0, kind, inputs, ref_loss, group) -> dict:
    """``remove_tensor_parallel``: the model is the one built again (its module types,
    tied parameters, hooks and attributes those of ``ref``, built alike and run alike),
    with the original values, and computes ``ref``'s loss exactly (the same modules and
    weights run the same ops)."""
    import torch

    from meshtrain.parallel.tensor import remove_tensor_parallel
    from tests.distributed.tp_models import loss_of

    def plain(m) -> dict:
        ties: dict[int, list[str]] = {}
        for name, p in m.named_parameters(remove_duplicate=False):
            ties.setdefault(id(p), []).append(name)
        return {
            "types": [type(x).__name__ for x in m.modules()],
            "ties": sorted(ties.values()),
            "hooks": sum(len(x._forward_hooks) + len(x._forward_pre_hooks) for x in m.modules())
            + sum(len(p._backward_hooks or {}) for p in m.parameters()),
            "attrs": [
                {k: v for k, v in vars(x).items() if isinstance(v, int | float | str | bool)}
                for x in m.modules()
            ],
            "keys": [sorted(k for k in vars(x) if not k.startswith("_")) for x in m.modules()],
        }

    remove_tensor_parallel(model, group)
    state = model.state_dict()
    same = {k: v == plain(ref)[k] for k, v in plain(model).items()}
    return {
        **same,
        "values": sorted(state) == sorted(full0)
        and all(torch.equal(state[k], full0[k]) for k in full0),
        "loss": float(loss_of(model, kind, inputs)) == float(ref_loss),
    }


def _generate(topo) -> dict:
    """Greedy ``generate()`` under tp equals one process; sequence parallel refuses it."""
    import torch

    from meshtrain.parallel.tensor import apply_tensor_parallel
    from tests.distributed.tp_models import batch, build

    ids = batch("llama")["input_ids"][:, :5]
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    out = {}
    with torch.no_grad():
        for kind in ("llama", "gpt2"):
            ref = build(kind).generate(ids, **kw)
            model = apply_tensor_parallel(build(kind), topo)
            tokens = model.generate(ids, **kw)
            out[kind] = {
                "equal": torch.equal(ref, tokens),
                "new": tokens.shape[1] - 5,
                "sharded": model(ids).logits.shape[-1],  # vocabulary shards again after it
            }
        sp = apply_tensor_parallel(build("llama"), topo, sequence_parallel=True)
        try:
            sp.generate(ids, **kw)
            out["refusal"] = None
        except Exception as exc:  # noqa: BLE001
            out["refusal"] = (type(exc).__name__, str(exc))
    return out


def _block_counts(topo) -> dict:
    """Calls and bytes of one decoder block, forward and backward, by (op, group)."""
    import torch

    from meshtrain.parallel.tensor import apply_tensor_parallel
    from tests.distributed.tp_models import build

    res = {}
    s = topo.stats
    for sp in (False, True):
        model = apply_tensor_parallel(build("decoder"), topo, sequence_parallel=sp)
        block = model.layers[0]
        B, S, H = 2, 8, 48
        seq = S // topo.tp_size if sp else S
        x = torch.randn(B, seq, H, requires_grad=True)
        cos, sin = model.rope_cos[:S], model.rope_sin[:S]
        c0, b0 = _calls(s), s.snapshot()
        y = block(x, cos, sin)
        c1, b1 = _calls(s), s.snapshot()
        y.sum().backward()
        c2, b2 = _calls(s), s.snapshot()
        res[sp] = {
            "fwd_bytes": s.diff(b1, b0),
            "bwd_bytes": s.diff(b2, b1),
            "fwd_calls": {k: c1[k] - c0.get(k, 0) for k in c1 if c1[k] - c0.get(k, 0)},
            "bwd_calls": {k: c2[k] - c1.get(k, 0) for k in c2 if c2[k] - c1.get(k, 0)},
        }
    return res


def _calls(stats) -> dict:
    return {op: stats.calls(op=op) for op in ("all_reduce", "all_gather", "reduce_scatter")}


def _dropout(topo) -> dict:
    """Masks inside a region differ across tp ranks; masks outside are identical."""
    import torch
    from torch import nn

    from meshtrain.distributed import comm
    from meshtrain.parallel.tensor import TPPlan, apply_tensor_parallel
    from tests.distributed.tp_models import build

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(16, 64)
            self.inner = nn.Dropout(0.5)
            self.down = nn.Linear(64, 16)
            self.outer = nn.Dropout(0.5)

        def forward(self, x):
            return self.outer(self.down(self.inner(self.up(x))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = Mlp()

        def forward(self, x):
            return self.mlp(x)

    plan = TPPlan(name="toy", rows=(("mlp", "region"), ("mlp.up", "column"), ("mlp.down", "row")))
    torch.manual_seed(1)
    net = apply_tensor_parallel(Net(), topo, plan=plan)
    masks = {}
    for name in ("inner", "outer"):
        getattr(net.mlp, name).register_forward_hook(
            lambda m, a, o, name=name: masks.__setitem__(name, (o == 0).float())
        )
    torch.manual_seed(2)  # every rank draws alike outside regions
    net(torch.randn(4, 16))

    def same_on_all(t):
        buf = torch.empty(topo.tp_size * t.numel())
        comm.all_gather(buf, t.reshape(-1).contiguous(), topo.tp_group, label="test")
        parts = buf.view(topo.tp_size, -1)
        return [bool(torch.equal(parts[0], p)) for p in parts[1:]]

    # GPT-2 with dropout everywhere: the replicated block outputs stay identical
    gpt = apply_tensor_parallel(build("gpt2", dropout=0.3), topo)
    gpt.train()
    seen = {}
    gpt.transformer.h[1].register_forward_hook(
        lambda m, a, o: seen.__setitem__("h", o[0] if isinstance(o, tuple) else o)
    )
    torch.manual_seed(3)
    gpt(torch.randint(0, 250, (2, 8)))

    # sequence parallel GPT-2: embedding and residual dropout run on this rank's tokens
    sp_gpt = apply_tensor_parallel(build("gpt2", dropout=0.3), topo, sequence_parallel=True)
    sp_gpt.train()
    sp_masks = {}
    for name, mod in (
        ("drop", sp_gpt.transformer.drop),
        ("resid", sp_gpt.transformer.h[0].attn.resid_dropout),
        ("mlp", sp_gpt.transformer.h[1].mlp.dropout),
    ):
        mod.register_forward_hook(
            lambda m, a, o, name=name: sp_masks.__setitem__(name, (o == 0).float())
        )
    torch.manual_seed(4)
    logits = sp_gpt(torch.randint(0, 250, (2, 8))).logits
    after = torch.get_rng_state().float()  # the default stream, after the forward
    return {
        "inner_same": same_on_all(masks["inner"]),
        "inner_frac": float(masks["inner"].mean()),
        "outer_same": same_on_all(masks["outer"]),
        "gpt2_block_out_same": same_on_all(seen["h"].detach()),
        "sp_same": {k: same_on_all(v) for k, v in sp_masks.items()},
        "sp_frac": {k: float(v.mean()) for k, v in sp_masks.items()},
        "sp_shapes": {k: tuple(v.shape) for k, v in sp_masks.items()},
        "sp_logits": tuple(logits.shape),
        "sp_default_stream_same": same_on_all(after),
    }


def _errors(topo) -> dict:
    from dataclasses import replace

    from torch import nn

    from meshtrain.parallel.tensor import TPPlan, apply_tensor_parallel
    from meshtrain.parallel.tensor.plans import GPT2
    from tests.distributed.tp_models import build

    out = {}

    class Unknown(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.emb = nn.Embedding(10, 4)

    for key, fn in {
        "no_plan": lambda: apply_tensor_parallel(Unknown(), topo),
        "overlap": lambda: apply_tensor_parallel(  # '*.output.dense' is both rows
            build("bert"),
            topo,
            plan=TPPlan(
                name="loose",
                rows=(
                    ("*attention.output.dense", "row"),
                    ("*.output.dense", "row"),
                ),
            ),
        ),
        "sp_refused": lambda: apply_tensor_parallel(
            build("gpt2"), topo, plan=replace(GPT2, sequence_parallel=False), sequence_parallel=True
        ),
    }.items():
        try:
            fn()
            out[key] = None
        except Exception as exc:  # noqa: BLE001
            out[key] = (type(exc).__name__, str(exc))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_models_match_one_process(world):
    results = run_ranks(_parity, world, world, timeout=400)
    B, S, H = 2, 8, 48
    b = B * S * H * 4  # one fp32 activation [B, S, H]
    w = H * 4  # one norm weight's fp32 gradient
    for out in results:
        for case in CASES if world != 3 else [c for c in CASES if c in out]:
            o = out[case]
            check(f"{case} loss", o["loss"], evaluation())
            check(f"{case} gradients", o["grad"], gradient())
            assert o["sizes"] and o["n_sharded"] > 0, (case, o)
            assert o["count"][0] == o["count"][1], (case, o)  # the estimator's per-rank count
            assert o["state_keys"] and o["state_equal"], (case, o)
            assert all(o["restored"].values()), (case, o["restored"])
        if world == 3:
            continue
        plain, sp = out["block"][False], out["block"][True]
        assert plain["fwd_bytes"] == {("all_reduce", "tp"): 2 * 2 * b}
        assert plain["fwd_calls"] == {"all_reduce": 2}
        assert plain["bwd_bytes"] == {("all_reduce", "tp"): 2 * 2 * b}
        assert plain["bwd_calls"] == {"all_reduce": 2}
        assert sp["fwd_bytes"] == {("all_gather", "tp"): 2 * b, ("reduce_scatter", "tp"): 2 * b}
        assert sp["fwd_calls"] == {"all_gather": 2, "reduce_scatter": 2}
        assert sp["bwd_bytes"] == {
            ("all_gather", "tp"): 2 * b,
            ("reduce_scatter", "tp"): 2 * b,
            ("all_reduce", "tp"): 2 * 2 * w,
        }
        assert sp["bwd_calls"] == {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 2}
        d = out["dropout"]
        assert not any(d["inner_same"]) and 0.3 < d["inner_frac"] < 0.7, d
        assert all(d["outer_same"]) and all(d["gpt2_block_out_same"]), d
        for name, same in d["sp_same"].items():  # on a sequence shard: a mask per rank
            assert not any(same) and 0.15 < d["sp_frac"][name] < 0.45, (name, d)
            assert d["sp_shapes"][name][1] == 8 // world, d  # ran on 1/T of the tokens
        assert d["sp_logits"] == (2, 8, -(-250 // world)), d  # full sequence, vocab shard
        assert all(d["sp_default_stream_same"]), d
        gen = out["generate"]
        for kind in ("llama", "gpt2"):
            assert gen[kind]["equal"] and gen[kind]["new"] == 6, gen
            assert gen[kind]["sharded"] == -(-250 // world), gen
        assert gen["refusal"][0] == "ConfigError" and "sequence_parallel" in gen["refusal"][1]
        e = out["errors"]
        assert e["no_plan"][0] == "ConfigError" and "proj" in e["no_plan"][1]
        assert "TPPlan(" in e["no_plan"][1]
        assert e["overlap"][0] == "ConfigError" and "both match" in e["overlap"][1], e
        assert "attention.output.dense" in e["overlap"][1], e
        assert e["sp_refused"][0] == "ConfigError"
        assert "sequence_parallel" in e["sp_refused"][1]

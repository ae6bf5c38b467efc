"""Pipeline parallelism against one process (fp32, gloo, real processes).

For every schedule (GPipe, 1F1B, interleaved 1F1B with 2 stages per rank, ZB-H1) at pp 2
and pp 4, on the reference decoder and tiny ``transformers`` Llama and GPT-2 (tied input
embedding and LM head, summed over the first and last stage): 10 SGD steps of 4
micro-batches whose sequence lengths differ (5..12 tokens; every third step one length for
all), with an evaluation at another batch size and micro-batch count mixed in after step 4. One process runs the same
micro-batches with gradient accumulation (loss / m per micro-batch).

Tolerances (``tests/tolerance.py``): the same fp32 operations in the same micro-batch
order; only the tied gradient is summed in a different order (embedding part + head part
after the step instead of per micro-batch). Losses and the parameters after 10 steps
(normwise per tensor, ``per_tensor``) within ``trajectory`` of SGD's per-element steps
(``sgd_rate``); every parameter's gradient on every rank at step 1 within ``gradient()``
and at step 10 within ``gradient_from`` the parameter bound. SGD with
momentum, not Adam: Adam divides by sqrt(v), so gradient entries that are zero in exact
arithmetic (GPT-2's key bias: softmax ignores a shift) turn 1e-10 rounding noise into
+-lr steps and the parameters would differ by 1e-4 whatever the pipeline does.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.tolerance import check, gradient, gradient_from, per_tensor, sgd_rate, trajectory

STEPS, MICRO = 10, 4
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1))
MODELS = ("decoder", "llama", "gpt2")


def build(kind: str, n_layers: int):
    torch.manual_seed(0)  # HF initialises from the global RNG: same weights everywhere
    if kind == "decoder":
        from meshtrain.models import Decoder, DecoderConfig

        cfg = DecoderConfig(
            vocab_size=64, dim=32, n_layers=n_layers, n_heads=2, ffn_dim=48, max_seq_len=16
        )
        return Decoder(cfg)
    if kind == "llama":
        from transformers import LlamaForCausalLM

        from tests.tiny_models import tiny_llama_config

        return LlamaForCausalLM(
            tiny_llama_config(
                intermediate_size=48,
                num_hidden_layers=n_layers,
                num_attention_heads=2,
                max_position_embeddings=16,
            )
        )
    from transformers import GPT2LMHeadModel

    from tests.tiny_models import tiny_gpt2_config

    return GPT2LMHeadModel(
        tiny_gpt2_config(
            vocab_size=64,
            n_embd=32,
            n_layer=n_layers,
            n_head=2,
            n_positions=16,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation=None,
        )
    )


def batches(kind: str, step: int, m: int = MICRO, rows: int = 2) -> list:
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for i in range(m):
        # every third step (and the evaluation, step 99) has one length for all its
        # micro-batches: receives posted on a guessed shape (``p2p``) are hit, and missed
        # at the next step's first length change
        length = 5 + (3 * i + step) % 8 if step % 3 else 5 + step % 8
        ids = torch.randint(0, 64, (rows, length), generator=g)
        out.append((ids, ids) if kind == "decoder" else {"input_ids": ids, "labels": ids})
    return out


def call(model, mb):
    return model(*mb) if isinstance(mb, tuple) else model(**mb).loss


def reference(kind: str, n_layers: int):
    """One process in a group of its own, with each rank's intra-op threads (the same
    matmul blocking); this process never runs a multi-threaded OpenMP region before it
    forks the ranks."""
    return run_ranks(_reference, 1, kind, n_layers)[0]


def _reference(kind: str, n_layers: int):
    model = build(kind, n_layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, grads = [], {}
    for step in range(STEPS):
        if step == 5:
            model.eval()
            with torch.no_grad():
                ev = [call(model, mb).item() for mb in batches(kind, 99, m=3, rows=5)]
            model.train()
            losses.append(sum(ev) / 3)
        opt.zero_grad()
        total = 0.0
        for mb in batches(kind, step):
            loss = call(model, mb)
            (loss / MICRO).backward()
            total += loss.item()
        losses.append(total / MICRO)
        if step in (0, STEPS - 1):
            grads[step] = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _pipeline_runs(n_layers: int):
    from meshtrain.distributed.topology import Topology
    from meshtrain.parallel.pipeline.runtime import PipelineRuntime
    from meshtrain.parallel.pipeline.split import split_model
    from meshtrain.parallel.pipeline.tied import tied_groups

    topo = Topology(pp=torch.distributed.get_world_size())
    p, out = topo.pp_size, {}
    for kind in MODELS:
        for name, v in SCHEDULES:
            model = build(kind, n_layers)
            stages = split_model(model, p * v)
            mine = {k: s for k, s in enumerate(stages) if k % p == topo.pp_rank}
            rt = PipelineRuntime(mine, topo.pp_group, p * v, name, tied_groups(stages, topo))
            named = {n: t for s in mine.values() for n, t in s.names.items()}
            opt = torch.optim.SGD(list(named.values()), lr=0.05, momentum=0.9)
            losses, grads = [], {}
            for step in range(STEPS):
                if step == 5:
                    losses.append(rt.eval_step(batches(kind, 99, m=3, rows=5)).item())
                opt.zero_grad()
                losses.append(rt.train_step(batches(kind, step)).item())
                if step in (0, STEPS - 1):
                    grads[step] = {n: t.grad.clone() for n, t in named.items()}
                opt.step()
            params = {n: t.detach().clone() for n, t in named.items()}
            sh = rt.shapes
            out[(kind, name)] = (losses, grads, params, (sh.hits, sh.misses, sh.dummies))
    return out


def _expected_guesses(kind: str) -> tuple[int, int]:
    """(hits, misses) of one activation channel, from the rule in ``p2p``: a receive is
    posted on a guess when the channel's last two shapes were equal, and hits when the
    next one is equal too. Every channel carries every micro-batch's ``(rows, length)``
    of every call in order (the evaluation before step 5)."""
    seq = []
    for step in range(STEPS):
        if step == 5:
            seq += [tuple(mb[0].shape) for mb in batches("decoder", 99, m=3, rows=5)]
        seq += [tuple(mb[0].shape) for mb in batches("decoder", step)]
    guessed = [k for k in range(2, len(seq)) if seq[k - 1] == seq[k - 2]]
    hits = sum(seq[k] == seq[k - 1] for k in guessed)
    return hits, len(guessed) - hits


def _normwise(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.slow
@pytest.mark.parametrize("pp,n_layers", [(2, 4), (4, 8)])
def test_pipeline_matches_one_process(pp, n_layers):
    import transformers  # noqa: F401  (imported once here; forked ranks inherit it)

    refs = {kind: reference(kind, n_layers) for kind in MODELS}
    per_rank = run_ranks(_pipeline_runs, pp, n_layers, timeout=400)
    hits, misses = _expected_guesses("decoder")
    assert hits >= 10 and misses >= 3, (hits, misses)  # the data exercises both paths
    for kind in MODELS:
        ref_losses, ref_grads, ref_params = refs[kind]
        for name, v in SCHEDULES:
            # each of the p * v - 1 stage boundaries is one channel; all count exactly
            counts = [got[(kind, name)][3] for got in per_rank]
            channels = pp * v - 1
            assert [sum(c[i] for c in counts) for i in range(3)] == [
                channels * hits,
                channels * misses,
                channels * misses,
            ], (kind, name, counts)
            seen = set()
            numel = sum(t.numel() for t in ref_params.values())
            tol = trajectory(sgd_rate(0.05, numel, momentum=0.9), len(ref_losses))
            first = min(ref_grads)
            for rank, got in enumerate(per_rank):
                losses, grads, params, _ = got[(kind, name)]
                where = f"{kind} {name} rank {rank}"
                for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
                    check(f"{where} loss {step}", abs(a - b) / abs(b), tol)
                for step, g in grads.items():
                    bound = gradient() if step == first else gradient_from(tol)
                    for n, t in g.items():
                        check(
                            f"{where} step {step} grad {n}", _normwise(t, ref_grads[step][n]), bound
                        )
                for n, t in params.items():
                    bound = per_tensor(tol, numel, t.numel())
                    check(f"{where} {n}", _normwise(t, ref_params[n]), bound)
                seen |= set(params)
            assert seen == set(ref_params), (kind, name)  # every parameter lives somewhere

"""The V-shaped zero-bubble schedules (zbv, dualpipev) train exactly like 1F1B.

Real gloo ranks, the engine's own path (``meshtrain.initialize`` with
``pipeline.schedule``): pp 2 on the reference decoder (untied) and a tiny transformers
Llama, pp 4 on the decoder; 4 AdamW steps of 4 (pp 2) or 8 (pp 4) micro-batches whose
sequence lengths vary. 1F1B cuts the model into ``p`` stages on ``p`` ranks; zbv and
dualpipev into ``2 p`` stages, rank ``r`` holding stages ``r`` and ``2p-1-r``.

Tolerance: exact (``tests/tolerance.py``'s first row). Every micro-batch goes through the
same layers with the same fp32 operations whatever the cut (a stage boundary only
detaches the activation and hands its gradient back), and every weight's gradient adds
the micro-batches' contributions in micro-batch order under each schedule (the
schedules' ``W`` of one stage run in micro-batch order, asserted in
``tests/parallel/test_pipeline_v_schedules.py``), so losses and the parameters after the
steps are bit for bit 1F1B's. An untied decoder: with a tied embedding the V puts the
embedding and the head on one rank, whose gradient then sums their parts interleaved
instead of part by part (same value to rounding, not bitwise).
"""

from __future__ import annotations

import torch

from tests.harness import run_ranks

STEPS, ROWS = 4, 2


def _model(kind: str, layers: int):
    torch.manual_seed(0)
    if kind == "llama":
        from tests.tiny_models import tiny_llama

        return tiny_llama(seed=3, num_hidden_layers=layers, attn_implementation="sdpa")
    from tests.tiny_models import tiny_decoder

    return tiny_decoder(n_layers=layers, tie_embeddings=False)


def _data(kind: str, step: int, m: int) -> list:
    g = torch.Generator().manual_seed(700 + step)
    out = []
    for i in range(m):
        ids = torch.randint(0, 64, (ROWS, 4 + 2 * ((i + step) % 3)), generator=g)
        out.append({"input_ids": ids, "labels": ids} if kind == "llama" else (ids, ids))
    return out


def _train(kind: str, layers: int, schedule: str, m: int) -> tuple:
    import meshtrain

    torch.set_num_threads(1)
    v = 2 if schedule in ("zbv", "dualpipev") else 1
    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": m,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "steps_per_print": 1000,
        "mesh": {"pipeline_parallel_size": torch.distributed.get_world_size()},
        "pipeline": {"schedule": schedule, "virtual_stages": v},
    }
    engine, *_ = meshtrain.initialize(model=_model(kind, layers), config=config)
    landed = _watch_landing(engine.zero)
    losses = [engine.train_batch(iter(_data(kind, s, m))).item() for s in range(STEPS)]
    stages = sorted(int(k) for k in engine.module.stages)
    params = {
        n: p.detach().clone() for s in engine.module.stages.values() for n, p in s.names.items()
    }
    return losses, params, stages, landed


def _watch_landing(zero) -> list:
    """``[written, not in the flat buffer]`` over every ``W``: a weight gradient written
    outside autograd's hooks must sit in ZeRO's buffer as soon as it is written, or each
    stage keeps a second copy of its gradients until the window's reduction."""
    counts = [0, 0]
    views = {p: v for g in zero.flat_groups for p, v in g.grad_views.items()}
    after = zero.after_backward

    def watched(written=()):
        after(written)
        counts[0] += len(written)
        counts[1] += sum(p.grad is not views[p] for p in written)

    zero.after_backward = watched
    return counts


def _ranks(runs: list) -> dict:
    out = {}
    for kind, layers, m, schedules in runs:
        for schedule in schedules:
            out[(kind, schedule)] = _train(kind, layers, schedule, m)
    return out


def _check(per_rank: list, runs: list) -> None:
    p = len(per_rank)
    for kind, _, _, schedules in runs:
        ref_losses, *_ = per_rank[0][(kind, "1f1b")]
        ref = {n: t for got in per_rank for n, t in got[(kind, "1f1b")][1].items()}
        for schedule in schedules[1:]:
            where = f"{kind} pp {p} {schedule}"
            merged: dict = {}
            for rank, got in enumerate(per_rank):
                losses, params, stages, (written, apart) = got[(kind, schedule)]
                assert stages == [rank, 2 * p - 1 - rank], (where, rank, stages)  # the V
                assert written > 0 and apart == 0, (where, rank, written, apart)
                assert losses == ref_losses, (where, rank, losses, ref_losses)  # bitwise
                merged.update(params)
            assert merged.keys() == ref.keys(), where
            for n, t in merged.items():
                assert torch.equal(t, ref[n]), (where, n, (t - ref[n]).abs().max())


def test_v_schedules_match_1f1b_exactly_at_pp2():
    import transformers  # noqa: F401  (imported once here; forked ranks inherit it)

    runs = [
        ("decoder", 4, 4, ("1f1b", "zbv", "dualpipev")),
        ("llama", 4, 4, ("1f1b", "zbv", "dualpipev")),
    ]
    _check(run_ranks(_ranks, 2, runs, timeout=400), runs)


def test_v_schedules_match_1f1b_exactly_at_pp4():
    runs = [("decoder", 8, 8, ("1f1b", "zbv", "dualpipev"))]
    _check(run_ranks(_ranks, 4, runs, timeout=400), runs)

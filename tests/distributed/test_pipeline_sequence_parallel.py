"""Sequence parallelism under a pipeline for the Llama-family plan (Megatron's layout):
stage 0 scatters the sequence after the embedding (at block 0's input), the activation
that crosses a stage boundary is each tp rank's ``1/T`` sequence shard, later stages run
their blocks on shards with positions, rotary tables and masks of the full length, and
the last stage's LM head all-gathers the sequence before its vocab-parallel loss.

One group of 4 processes, pp 2 x tp 2 (dp 1), a tiny transformers ``LlamaForCausalLM``
(4 blocks, grouped-query attention) through ``meshtrain.initialize`` and
``engine.train_batch``, 3 SGD steps of 4 micro-batches whose sequence lengths vary (4, 6,
8: multiples of T = 2), clipping at 0.05 (below the norm on every step, so matching the
reference proves the norm is global over stages and tp):

* sequence parallel, 1F1B;
* sequence parallel, interleaved 1F1B with 2 chunks per rank (4 stages of one block);
* sequence parallel, ZB-H1 (its weight-gradient step walks what the input-gradient step
  saved, from the received shard through the first block's swapped-in input);
* without sequence parallelism, 1F1B (the byte baseline; also held to the reference);
* a micro-batch of odd length: every rank raises TopologyError before the schedule posts
  anything (no rank left waiting), and the parameters are unchanged;
* a ``meshtrain.pipe.PipelineModule`` with sequence parallelism: refused with a
  ConfigError (its layer list has no place to split and gather the sequence). (GPT-2
  with sequence parallelism under a pipeline, refused here before, now trains:
  ``tests/distributed/test_pipeline_module_tp.py``.)

Tolerances (fp32, ``tests/tolerance.py``), against the same engine in one process: the
arithmetic is the one-process arithmetic summed in another order (tp partial sums in the
row layers and the vocab-parallel loss, the norm weights' gradients summed over the tp
ranks' tokens): losses within ``trajectory`` of SGD's per-element steps per step, every
parameter (tp shards gathered to the full tensor) within ``per_tensor`` of it after the
last step (measured: losses 1.1e-7), the global gradient norm of every run within
``norm_from`` it (``check_run``), against one process and against the pp 2 x tp 2 run
without sequence parallelism. The norm's bound includes the norm's own sum in another
order: the one-process engine takes it with an fp32 ``vector_norm`` over one ~41k-element
flat gradient, 1.7504631 on step 0 where the float64 norm of the same gradients is
1.7504663 (-1.8e-6); the pp 2 x tp 2 runs, which sum squares per shard, report 1.7504663
(within 3e-8 of float64).

Bytes, exact (``CommStats``, op label ``pp_p2p``, per rank and step): each rank of a
pp 2 pipeline moves, per micro-batch ``i`` of ``b x t_i`` tokens, the activation one way
and its gradient the other, ``b t_i d 4`` bytes each without sequence parallelism and
``b t_i d 4 / T`` with it, plus a shape header of fixed size. So the SP run's bytes minus
``2 sum_i b t_i d 4 / T`` equal the non-SP run's minus ``2 sum_i b t_i d 4`` (the headers,
the same in both), for every step; interleaved (3 boundaries, each on both ranks) moves
exactly 3 times the 1F1B SP bytes, and ZB-H1 the same as 1F1B.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_pipeline_3d import _data
from tests.distributed.test_pipeline_combos import _full_params
from tests.harness import run_ranks
from tests.tolerance import check, check_run, norm_from, sgd_rate, trajectory

STEPS = 3
ROWS = 2
HIDDEN = 32  # tiny_llama's hidden_size
CLIP = 0.05


def _llama():
    from tests.tiny_models import tiny_llama

    return tiny_llama(seed=3, num_hidden_layers=4, attn_implementation="sdpa")


def _engine(pp: int, tp: int, sp: bool, schedule: str = "1f1b", v: int = 1):
    import meshtrain

    torch.set_num_threads(1)
    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
        "mesh": {"pipeline_parallel_size": pp, "tensor_parallel_size": tp},
        "pipeline": {"schedule": schedule, "virtual_stages": v},
        "tensor_parallel": {"sequence_parallel": sp},
    }
    engine, *_ = meshtrain.initialize(model=_llama(), config=config)
    return engine


def _run(engine) -> tuple:
    """STEPS steps; (losses, norms, full parameters, pp_p2p bytes per step)."""
    stats = engine.topology.stats
    losses, norms, p2p = [], [], []
    for step in range(STEPS):
        before = stats.snapshot()
        losses.append(engine.train_batch(iter(_data("llama", step))).item())
        norms.append(engine.get_global_grad_norm())
        moved = stats.diff(stats.snapshot(), before)
        p2p.append(sum(n for (op, _group), n in moved.items() if op == "pp_p2p"))
    return losses, norms, _full_params(engine), p2p


def _odd_length(engine) -> tuple[str, bool]:
    """A step with a micro-batch of odd length under sequence parallelism."""
    from meshtrain.errors import TopologyError

    before = [p.detach().clone() for p in engine.module.parameters()]
    batches = _data("llama", 0)
    ids = batches[2]["input_ids"][:, :5]
    batches[2] = {"input_ids": ids, "labels": ids}
    with pytest.raises(TopologyError, match="multiple of") as err:
        engine.train_batch(iter(batches))
    same = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))
    return str(err.value), same


def _four_ranks() -> tuple:
    sp = _engine(2, 2, True)
    runs = {"sp_1f1b": _run(sp)}
    odd = _odd_length(sp)
    runs["sp_interleaved"] = _run(_engine(2, 2, True, "interleaved_1f1b", 2))
    runs["sp_zb_h1"] = _run(_engine(2, 2, True, "zb_h1"))
    runs["no_sp_1f1b"] = _run(_engine(2, 2, False))
    return runs, odd, _pipeline_module_sp_refused()


def _pipeline_module_sp_refused() -> str:
    import meshtrain
    from meshtrain.distributed.topology import Topology
    from meshtrain.errors import ConfigError
    from meshtrain.pipe import PipelineModule
    from tests.tiny_models import tiny_pipe_layers

    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "mesh": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
        "tensor_parallel": {"sequence_parallel": True},
    }
    topo = Topology(pp=2, tp=2)
    layers, loss_fn = tiny_pipe_layers()
    model = PipelineModule(layers, topology=topo, loss_fn=loss_fn)
    with pytest.raises(ConfigError) as err:
        meshtrain.initialize(model=model, config=config, topology=topo)
    return str(err.value)


def _reference():
    return _run(_engine(1, 1, False))


@pytest.fixture(scope="module")
def ref():
    return run_ranks(_reference, 1)[0]


def _activation_bytes(step: int) -> int:
    """``sum_i b t_i d 4``: one direction's bytes of the step's boundary activations."""
    return sum(b["input_ids"].numel() * HIDDEN * 4 for b in _data("llama", step))


def test_llama_sequence_parallel_under_pipeline(ref):
    per_rank = run_ranks(_four_ranks, 4, timeout=300)
    runs = [r for r, _, _ in per_rank]
    keys = ("sp_1f1b", "sp_interleaved", "sp_zb_h1", "no_sp_1f1b")
    ref_losses, ref_norms, ref_params, _ = ref
    assert all(n > CLIP for n in ref_norms)  # clipping acts on every step
    numel = sum(t.numel() for t in ref_params.values())
    tol = trajectory(sgd_rate(0.05, numel, momentum=0.9), STEPS)
    for rank, r in enumerate(runs):
        for key in keys:
            losses, norms, params, _ = r[key]
            check_run(f"{key} rank {rank}", (losses, norms, params), ref[:3], tol)
            for step, (a, b) in enumerate(zip(norms, r["no_sp_1f1b"][1], strict=True)):
                check(
                    f"{key} rank {rank} norm {step} vs no sp", abs(a - b) / b, norm_from(tol, numel)
                )
    assert set().union(*(r["sp_1f1b"][2] for r in runs)) == set(ref_params)
    t = 2
    for r in runs:
        sp, inter, full = r["sp_1f1b"][3], r["sp_interleaved"][3], r["no_sp_1f1b"][3]
        for step in range(STEPS):
            a = _activation_bytes(step)
            headers = full[step] - 2 * a
            assert 0 <= headers < 2 * a // 10, (full, a)  # a fixed header per micro-batch
            assert sp[step] - 2 * a // t == headers, (sp, full, a)
            assert inter[step] == 3 * sp[step], (inter, sp)
        assert r["sp_zb_h1"][3] == sp, (r["sp_zb_h1"][3], sp)
    for _, (msg, unchanged), refused in per_rank:
        assert "sequence length 5" in msg and "tensor_parallel_size 2" in msg, msg
        assert unchanged
        assert "tensor_parallel.sequence_parallel" in refused and "false" in refused, refused

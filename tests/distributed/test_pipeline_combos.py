"""Pipeline combinations the 3D tests leave out, on 4 processes (one process group),
against the same engine in one process (``test_pipeline_3d``'s reference: 4 SGD steps of
the tied tiny decoder, 4 micro-batches of varying sequence length, clipping at 0.05):

* ZB-H1 with tensor parallelism *and* sequence parallelism (pp 2 x tp 2): the activations
  travel as each tp rank's sequence shard, the weight-gradient step starts from what the
  input-gradient step saved inside the sequence-parallel layers;
* ZeRO 2 with ZB-H1 and ``zero_optimization.ignore_unused_parameters: false`` (pp 2 x
  dp 2): ZB-H1's weight-gradient step writes ``.grad`` without autograd's accumulation
  hooks, which the unused-parameter check counts on;
* pp x tp checkpoints: saved at pp 2 x tp 2 after 2 steps, loaded at pp 1 x tp 2 x dp 2
  and at pp 2 x tp 1 x dp 2 (ZeRO 1), each continuing the last 2 steps;
* a pipeline step that raised midway makes the next call raise TrainingError (its
  early-posted receives would take that call's data).

Tolerances as in ``test_pipeline_3d`` (fp32, ``tests/tolerance.py``): losses within
``trajectory`` of SGD's per-element steps, global gradient norms within ``gradient_from``
it, every parameter (tp shards gathered to the full tensor) within ``per_tensor`` of it:
the same sums in another order (tp partial sums, dp averages, the tied gradient added
across stages). A loaded run is held
to the same: the checkpoint carries the parameters and SGD's momentum exactly, the rest
is the same arithmetic as the unbroken run.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_pipeline_3d import _check, _data, _model, _train
from tests.harness import run_ranks

STEPS = 4
ROWS = 2


def _engine(pp: int, tp: int, zero: int, schedule: str, **extra):
    import meshtrain

    torch.set_num_threads(1)
    dp = torch.distributed.get_world_size() // (pp * tp)
    config = {
        "train_micro_batch_size_per_gpu": ROWS // dp,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "gradient_clipping": 0.05,
        "steps_per_print": 1000,
        "mesh": {"pipeline_parallel_size": pp, "tensor_parallel_size": tp},
        "zero_optimization": {"stage": zero, **extra.pop("zero_extra", {})},
        "pipeline": {"schedule": schedule},
        **extra,
    }
    engine, *_ = meshtrain.initialize(model=_model("decoder"), config=config)
    return engine


def _steps(engine, first: int, n: int, losses: list, norms: list) -> None:
    dp, r = engine.topology.dp_size, engine.topology.dp_rank
    part = slice(r * ROWS // dp, (r + 1) * ROWS // dp)
    for step in range(first, first + n):
        losses.append(engine.train_batch(iter(_data("decoder", step, part))).item())
        norms.append(engine.get_global_grad_norm())


def _full_params(engine) -> dict:
    from meshtrain.parallel.tensor.sharding import specs_by_param, unshard_tensor

    module = engine.module
    if engine.pipeline is None:
        params = dict(module.named_parameters())
    else:
        params = {n: p for s in module.stages.values() for n, p in s.names.items()}
    specs = specs_by_param(module)
    full = {}
    for name in sorted(params):  # the same order on every tp rank of a stage
        p, spec = params[name].detach(), specs.get(id(params[name]))
        full[name] = (
            p.clone() if spec is None else unshard_tensor(p, spec, engine.topology.tp_group)
        )
    return full


def _run(engine) -> tuple:
    losses, norms = [], []
    _steps(engine, 0, STEPS, losses, norms)
    return losses, norms, _full_params(engine)


class _Failing(torch.nn.Module):
    def forward(self, x, batch):
        raise ValueError("a stage failed")


def _midway_guard() -> str:
    """A step that raised midway: the next call on that runtime is refused (its receives
    would still be posted); returns the message."""
    from meshtrain.distributed.topology import Topology
    from meshtrain.errors import TrainingError
    from meshtrain.parallel.pipeline.runtime import PipelineRuntime

    rt = PipelineRuntime({0: _Failing()}, Topology(pp=1).pp_group, 1, "1f1b")
    with pytest.raises(ValueError, match="a stage failed"):
        rt.train_step([torch.zeros(1)])
    with pytest.raises(TrainingError, match="raised before it finished") as err:
        rt.eval_step([torch.zeros(1)])
    return str(err.value)


def _four_ranks(tmp: str) -> dict:
    runs = {
        "zb_tp_sp": _run(_engine(2, 2, 0, "zb_h1", tensor_parallel={"sequence_parallel": True})),
        "zb_zero2_strict": _run(
            _engine(2, 1, 2, "zb_h1", zero_extra={"ignore_unused_parameters": False})
        ),
    }
    # pp 2 x tp 2: 2 steps, save, then loaded at other layouts for the last 2 steps
    saver = _engine(2, 2, 0, "1f1b")
    head_losses, head_norms = [], []
    _steps(saver, 0, 2, head_losses, head_norms)
    saver.save_checkpoint(tmp, tag="pptp")
    for key, (pp, tp, zero) in {"load_pp1_tp2": (1, 2, 0), "load_pp2_tp1": (2, 1, 1)}.items():
        engine = _engine(pp, tp, zero, "1f1b")
        engine.load_checkpoint(tmp, tag="pptp")
        losses, norms = list(head_losses), list(head_norms)
        _steps(engine, 2, 2, losses, norms)
        runs[key] = (losses, norms, _full_params(engine))
    return runs, _midway_guard()


@pytest.fixture(scope="module")
def refs():
    return {"decoder": run_ranks(_train, 1, "decoder", 1, 1, 1, 0, "1f1b", 1)[0]}


def test_pipeline_combinations(refs, tmp_path):
    per_rank = run_ranks(_four_ranks, 4, str(tmp_path), timeout=600)
    keys = ("zb_tp_sp", "zb_zero2_strict", "load_pp1_tp2", "load_pp2_tp1")
    _check([runs for runs, _ in per_rank], refs, dict.fromkeys(keys, "decoder"))
    assert all("restart the job" in msg for _, msg in per_rank), per_rank[0][1]

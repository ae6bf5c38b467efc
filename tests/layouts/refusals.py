"""What stays refused outside the matrix's five sizes: the pipeline's schedule and model
forms (a ``PipelineModule``, a traced split) crossed with tensor parallelism.

Each row is a model and a config that ``meshtrain.initialize`` refuses by name on real
ranks, and the start of the ``ConfigError`` it raises; ``test_refusals.py`` initializes
every row in one 4-rank group and asserts that line, and ``matrix.render`` lists the rows
in docs/layouts.md, so the docs say what the engine says.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WORLD = 4  # every row's mesh fits on these ranks (what is not split is dp)


@dataclass(frozen=True)
class Refusal:
    """``what`` a user asks for; the ``model`` (``build``'s name) and ``config`` (merged
    over a plain fp32 AdamW config) that ask for it; the ``line`` the refusal starts with."""

    what: str
    model: str
    config: dict = field(hash=False)
    line: str


def _mesh(pp: int = 1, tp: int = 1) -> dict:
    return {"pipeline_parallel_size": pp, "tensor_parallel_size": tp}


REFUSALS = (
    Refusal(
        "a `meshtrain.pipe.PipelineModule` under sequence parallelism",
        "pipeline_module",
        {"mesh": _mesh(2, 2), "tensor_parallel": {"sequence_parallel": True}},
        "tensor_parallel.sequence_parallel with mesh.tensor_parallel_size=2 and a "
        "meshtrain.pipe.PipelineModule is not implemented",
    ),
    Refusal(
        "a `PipelineModule` under the V schedules (`zbv`, `dualpipev`)",
        "pipeline_module",
        {"mesh": _mesh(2), "pipeline": {"schedule": "zbv", "virtual_stages": 2}},
        "pipeline.schedule: zbv with a meshtrain.pipe.PipelineModule is not implemented",
    ),
    Refusal(
        "`zbv` / `dualpipev` with `pipeline.virtual_stages` other than 2",
        "decoder",
        {"mesh": _mesh(2), "pipeline": {"schedule": "zbv", "virtual_stages": 1}},
        'pipeline.virtual_stages: 1 with pipeline.schedule "zbv": it holds two stages per '
        "rank in a V",
    ),
    Refusal(
        "`dualpipev` with fewer than 2 x pp micro-batches per step",
        "decoder",
        {"mesh": _mesh(2), "pipeline": {"schedule": "dualpipev", "virtual_stages": 2}},
        "pipeline.schedule: dualpipev needs at least 2 x pp = 4 micro-batches per step",
    ),
    Refusal(
        "sequence parallelism over a traced split (a model with no block list)",
        "linear_chain",
        {"mesh": _mesh(2, 2), "tensor_parallel": {"sequence_parallel": True}},
        "tensor_parallel.sequence_parallel with mesh.pipeline_parallel_size > 1 is not "
        "implemented for LinearChain: it has no known block list",
    ),
    Refusal(
        "sequence parallelism with a plan that has no row splitting the sequence",
        "linear_chain",
        {"mesh": _mesh(1, 2), "tensor_parallel": {"sequence_parallel": True}},
        "tensor_parallel.sequence_parallel: the 'config plan' plan has no row that splits "
        "the sequence over the tp ranks",
    ),
)


def build(name: str):
    """A row's model: the matrix's Decoder, a ``PipelineModule`` of tiny residual blocks, or
    the four-linear ``LinearChain`` (its tp plan goes into the config, ``config``)."""
    from tests.layouts.matrix import build as matrix_model
    from tests.tiny_models import LinearChain, tiny_pipe_layers

    if name == "pipeline_module":
        from meshtrain.pipe import PipelineModule

        layers, loss_fn = tiny_pipe_layers()
        return PipelineModule(layers, loss_fn=loss_fn)
    if name == "linear_chain":
        return LinearChain()
    return matrix_model(name)


def config(row: Refusal) -> dict:
    """The row's config over an fp32 AdamW one of 2 micro-batches per step."""
    from tests.tiny_models import LINEAR_CHAIN_PLAN

    out = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "steps_per_print": 10_000,
    }
    out.update(row.config)
    if row.model == "linear_chain":
        out["tensor_parallel"] = {**out.get("tensor_parallel", {}), "plan": LINEAR_CHAIN_PLAN}
    return out


def raised() -> list[str]:
    """On each rank: every row's ``initialize``, the first line of the ``ConfigError``
    it raised (or what happened instead)."""
    import meshtrain
    from meshtrain.errors import ConfigError

    out = []
    for row in REFUSALS:
        try:
            meshtrain.initialize(model=build(row.model), config=config(row))
        except ConfigError as exc:
            out.append(str(exc).splitlines()[0])
        else:
            out.append("initialized: no refusal")
    return out


__all__ = ["REFUSALS", "WORLD", "Refusal", "build", "config", "raised"]

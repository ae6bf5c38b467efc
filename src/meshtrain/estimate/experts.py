"""Expert and non-expert parameters per rank under expert parallelism, for ``meshtrain
estimate --ep E``.

A mixture-of-experts model's trainable parameters ``Psi = Psi_d + Psi_e`` split into the
non-expert ones ``Psi_d`` (attention, norms, routers, embeddings, shared experts) and the
routed experts ``Psi_e`` (all ``E`` experts of every MoE layer). With ep ranks carved out
of the ``N_d`` data-parallel ranks, a rank holds

* ``Psi_d / (tp pp)`` non-expert parameters, replicated over ``N_d`` ranks: ZeRO
  partitions them over ``N_d``. For a model with a tensor-parallel plan the tp share is
  exact instead (``parallel.tensor.sizes``): norms, routers and shared experts stay whole
  on every tp rank, as tensor parallelism leaves every MoE block;
* ``Psi_e / (ep pp)`` expert parameters (experts are not split over tp), replicated over
  the ``N_d / ep`` ranks of its edp group: ZeRO partitions them over ``N_d / ep``.

so the model states per rank are the ZeRO formula applied to each part with its own
degree (``model_states.model_states_bytes``, ``ep=``). Which parameters are experts: in a
built model those marked by expert sharding (``meshtrain.parallel.experts``); in a model
not yet sharded (a meta-device model from a config), those under a module named
``experts`` (transformers' Mixtral ``block_sparse_moe.experts``, Qwen2/3-MoE
``mlp.experts``; Qwen's ``shared_expert`` is replicated and counts as non-expert).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from meshtrain.errors import ConfigError
from meshtrain.parallel.experts import is_expert_param

__all__ = [
    "ExpertCounts",
    "dense_on_one_tp_rank",
    "expert_counts",
    "is_expert_name",
    "split_expert_params",
]


def is_expert_name(name: str) -> bool:
    """A parameter name under a module called ``experts`` (module docstring)."""
    return "experts" in name.split(".")[:-1]


def split_expert_params(model: nn.Module) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((trainable, frozen) non-expert, (trainable, frozen) expert)`` element counts of
    the whole model; a tied parameter counted once."""
    counts = [[0, 0], [0, 0]]
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        kind = 1 if is_expert_param(p) or is_expert_name(name) else 0
        counts[kind][0 if p.requires_grad else 1] += p.numel()
    return (counts[0][0], counts[0][1]), (counts[1][0], counts[1][1])


@dataclass(frozen=True)
class ExpertCounts:
    """Parameters of the whole model and of one rank, by kind."""

    dense: int  # non-expert parameters of the whole model
    expert: int  # expert parameters of the whole model (all E experts)
    ep: int
    tp: int = 1
    pp: int = 1
    dense_tp_local: int | None = None  # exact non-expert count on one tp rank, from a plan

    @property
    def dense_per_rank(self) -> int:
        if self.dense_tp_local is not None:
            return -(-self.dense_tp_local // self.pp)
        return -(-self.dense // (self.tp * self.pp))

    @property
    def expert_per_rank(self) -> int:
        return -(-self.expert // (self.ep * self.pp))

    @property
    def per_rank(self) -> int:
        return self.dense_per_rank + self.expert_per_rank

    def line(self) -> str:
        """One line for the estimate table's header."""
        return (
            f"ep={self.ep}: {self.expert:,} expert parameters ({self.expert_per_rank:,} per "
            f"rank, sharded over ep) + {self.dense:,} non-expert ({self.dense_per_rank:,} per "
            f"rank) = {self.per_rank:,} per rank"
        )


def expert_counts(
    dense: int,
    expert: int,
    *,
    ep: int,
    dp: int,
    tp: int = 1,
    pp: int = 1,
    dense_tp_local: int | None = None,
):
    """``ExpertCounts`` after checking that ``ep`` divides ``dp`` (ep is carved out of dp)."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ConfigError(f"ep: must be an integer >= 1, got {ep!r}")
    if dp % ep:
        raise ConfigError(
            f"ep: expert parallelism is carved out of the data-parallel ranks, so ep {ep} "
            f"must divide dp {dp}; pick an ep that divides dp"
        )
    if ep > 1 and expert == 0:
        raise ConfigError(
            f"ep: {ep} but the model has no expert parameters (none marked, none under a "
            "module named 'experts'); give --expert-params N with --params, or ep 1"
        )
    return ExpertCounts(
        dense=dense, expert=expert, ep=ep, tp=tp, pp=pp, dense_tp_local=dense_tp_local
    )


def dense_on_one_tp_rank(source, tp: int) -> tuple[int, int] | None:
    """``(trainable, frozen)`` non-expert elements one tp rank holds of a model with a
    tensor-parallel plan (exact: MoE blocks and norms whole, padding counted); None for a
    parameter count, tp 1 or a model without a plan (then ``Psi_d / tp``)."""
    if tp == 1 or not isinstance(source, nn.Module):
        return None
    from meshtrain.parallel.tensor.plans import plan_for
    from meshtrain.parallel.tensor.sizes import local_parameter_counts

    if plan_for(source) is None:
        return None
    trainable, frozen = local_parameter_counts(source, tp)  # experts whole: not tp-sharded
    _, (expert, expert_frozen) = split_expert_params(source)
    return trainable - expert, frozen - expert_frozen


def split_model(source, expert_params: int | float = 0) -> tuple[tuple[int, int], tuple[int, int]]:
    """``split_expert_params`` of a model, or ``(total - expert_params, 0), (expert_params,
    0)`` for a trainable parameter count."""
    if isinstance(source, nn.Module):
        if expert_params:
            raise ConfigError(
                "expert_params: given with a model, whose experts are counted from it; "
                "leave expert_params out (or pass a parameter count instead of the model)"
            )
        return split_expert_params(source)
    if isinstance(source, bool) or not isinstance(source, (int, float)) or source < 1:
        raise ConfigError(f"num_params: must be a count >= 1 or a torch.nn.Module, got {source!r}")
    total, expert = int(round(source)), int(round(expert_params))
    if not 0 <= expert <= total:
        raise ConfigError(
            f"expert_params: {expert_params!r} must be between 0 and num_params {total} "
            "(the routed experts among the trainable parameters)"
        )
    return (total - expert, 0), (expert, 0)

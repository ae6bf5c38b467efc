"""The router's load-balancing loss of a mixture-of-experts model cut into pipeline stages.

The loss one process computes (``parallel.experts.aux_loss``, transformers'
``load_balancing_loss_func``) is over *every* layer's router logits at once::

    aux = E * sum_e (C_e / R) * (S_e / R)     C_e: top-k assignments to e, S_e: summed
                                              probabilities of e, R: rows; each summed
                                              over all layers (and all replicas' tokens)

It is not a sum of per-layer terms, so no stage can compute its share from its own
layers. But ``C`` and ``R`` carry no gradient (top-k, counting), so ``aux`` is linear in
``S = sum_k S^k`` (``S^k``: stage ``k``'s layers). Each stage therefore carries the running
sums forward with its activation, and autograd carries ``d loss / d S`` back:

* stage ``k`` sends one flat tensor ``[hidden, S_<=k (E), C_<=k (E), R_<=k, dtype code,
  *hidden.shape, ndim]`` (its received sums plus its own layers', in layer order, so the
  additions are the ones one process makes); ``S`` keeps its graph, ``C`` and ``R`` are
  detached;
* the last stage adds its layers, all-reduces ``C`` and ``R`` over the replicas (dp x cp:
  ``E + 1`` floats, ``control``, exactly as without a pipeline), and adds
  ``coef x aux`` to the model's own loss (whose stage-local auxiliary term is switched off:
  the Decoder's ``aux_in_forward``, transformers' ``output_router_logits=False``). Its loss
  is the one-process loss of the micro-batch;
* the backward sends the gradient of that flat tensor, whose ``S`` slots hold
  ``d loss / d S_e = scale x coef x E x W x C_e / R^2`` (``W`` replicas, ``scale`` the
  runtime's ``loss_scale / m``): the stage's backward runs it into its own routers
  (through ``S^k``) and on to the previous stage (through ``S_<k``). So every router gets
  exactly the one-process gradient, through its own stage's backward, without any
  collective beyond the pipeline's p2p and the replicas' all-reduce.

Tensor parallelism: without sequence parallelism every tp rank of a stage routes the
same tokens, so its sums are the replica's and each tp rank computes the same ``aux``
(the routers are replicated and get the same gradient on each). With sequence
parallelism each tp rank's routers see its ``1/T`` shard of the sequence and send their
own partial sums to the same tp rank of the next stage; the last stage sums ``C`` and
``R`` over tp too and returns the value of the whole sequence with the gradient of its
own shard's term (``balance_loss``'s ``sequence``), the MoE blocks' gradient hooks summing
the routers' gradients over tp (``parallel.tensor.moe_blocks``), as without a pipeline.

Context parallelism: each cp rank's stages route its chunk of the replica's rows
(``chunks``: the mask, all ones for a MoE model under cp, is not applied to a chunk) and
carry that chunk's sums; the last stage all-reduces ``C`` and ``R`` over the cp group (by
default; over dp x cp with ``loss.global_aux_loss``) and scales its ``S`` by the group
size, the rule ``parallel.experts.aux_loss`` applies without a pipeline: the cp ranks'
gradients, averaged over the replica group, are then the one-process gradient. Its value
is the mean of the cp ranks' terms (one more 4-byte all-reduce over cp, ``control``), as
the cp sharder averages the model's own loss.

Micro-batches: the loss is per micro-batch (as each ``forward`` of one process with
gradient accumulation computes it); the step's loss is the mean over micro-batches.

Bytes: ``(2 E + 3 + ndim) x 4`` more per activation and per gradient message. The flat
tensor is fp32: with bf16/fp16 activations the hidden states cross the boundary as fp32
(twice the bytes; the cast back is exact).

The routers are found as the ``router`` (meshtrain's ``MoE``) or ``gate`` (transformers'
sparse-MoE blocks) of every module with an ``experts`` child in the stage's blocks; a
forward hook keeps their logits (output ``[0]`` for transformers' routers, which return a
tuple), skipping a recomputation inside backward (activation checkpointing).
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.distributed import comm
from meshtrain.distributed.comm import Group
from meshtrain.errors import ConfigError
from meshtrain.parallel.experts.aux_loss import balance_loss, router_sums

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def model_aux(model: nn.Module) -> dict | None:
    """``{num_experts, top_k, routing, coef, kind}`` of a MoE model whose loss adds the
    router's auxiliary loss (meshtrain's Decoder with ``model.moe`` and a nonzero
    coefficient, a transformers ``...ForCausalLM`` with ``output_router_logits`` and
    ``router_aux_loss_coef``); None otherwise."""
    config = getattr(model, "config", None)
    moe = getattr(config, "moe", None)
    if moe is not None and hasattr(model, "aux_group"):  # meshtrain Decoder
        if not moe.router_aux_loss_coef:
            return None
        return dict(
            num_experts=moe.n_experts,
            top_k=moe.top_k,
            routing=moe.routing,
            coef=float(moe.router_aux_loss_coef),
            kind="decoder",
        )
    coef = getattr(model, "router_aux_loss_coef", None)
    if coef is None or not getattr(config, "output_router_logits", False):
        return None
    if not hasattr(model, "num_experts") or not hasattr(model, "num_experts_per_tok"):
        return None
    return dict(
        num_experts=int(model.num_experts),
        top_k=int(model.num_experts_per_tok),
        routing="softmax_topk",
        coef=float(coef),
        kind="transformers",
    )


def check_pipeline_moe(model: nn.Module, topology) -> None:
    """Refuse, by name, the MoE models a pipeline cannot cut yet: experts of a family
    meshtrain does not know (their router and auxiliary loss are not found), and a
    ``meshtrain.pipe.PipelineModule`` with MoE layers (its stages run the user's
    ``loss_fn``, which no auxiliary term reaches). Tensor parallelism of a pipelined MoE
    model runs: without sequence parallelism every tp rank routes the same tokens (its
    sums are the replica's); with it each rank's sums are of its sequence shard, combined
    over tp on the last stage (module docstring)."""
    from meshtrain.parallel.experts.routed import RoutedExperts
    from meshtrain.parallel.experts.shard import FAMILIES, holds_experts
    from meshtrain.parallel.pipeline.module import PipelineModule

    pp = topology.pp_size
    for name, module in model.named_modules():
        known = isinstance(module, RoutedExperts) or type(module).__name__ in FAMILIES
        if known and isinstance(model, PipelineModule):
            raise ConfigError(
                f"mesh.pipeline_parallel_size: {pp} with a meshtrain.pipe.PipelineModule "
                f"holding MoE layers ({name}) is not built: the router's auxiliary loss "
                "does not reach its loss_fn; pipeline a Decoder with model.moe or a "
                "transformers Mixtral / Qwen2-MoE / Qwen3-MoE, or set "
                "pipeline_parallel_size 1"
            )
        if not known and holds_experts(name, module):
            raise ConfigError(
                f"mesh.pipeline_parallel_size: {pp} with {name} ({type(module).__name__}): "
                "pipeline parallelism of MoE layers supports "
                f"{', '.join(FAMILIES)} and meshtrain's Decoder (model.moe); set "
                "pipeline_parallel_size 1"
            )


def stage_routers(blocks: nn.Module) -> list[nn.Module]:
    """The router of every MoE layer in ``blocks``, in forward order."""
    out = []
    for m in blocks.modules():
        if isinstance(getattr(m, "experts", None), nn.Module):
            router = getattr(m, "router", None) or getattr(m, "gate", None)
            if not isinstance(router, nn.Module):
                raise ConfigError(
                    f"{type(m).__name__} has experts but no `router` or `gate` module: "
                    "meshtrain cannot find its router logits for the auxiliary loss under "
                    "mesh.pipeline_parallel_size > 1; set pipeline_parallel_size 1"
                )
            out.append(router)
    return out


class StageRouterAux:
    """One pipeline stage's part of the auxiliary loss (see the module docstring)."""

    def __init__(
        self,
        routers: list[nn.Module],
        spec: dict,
        replicas: Group | None,
        is_first: bool,
        is_last: bool,
        sequence: Group | None = None,
        chunks: Group | None = None,
    ) -> None:
        self.spec, self.replicas = spec, replicas
        # under context parallelism the routers see this cp rank's chunk of the rows and
        # the model's sharder has dropped the mask (which it requires to be all ones for a
        # MoE model): every token the routers saw counts. ``chunks``: the cp group
        self.chunks = chunks
        self.sequence = sequence  # the tp group under sequence parallelism, else None
        self.is_first, self.is_last = is_first, is_last
        self.num_experts = spec["num_experts"]
        self._logits: list[torch.Tensor] = []
        self._hooks = [r.register_forward_hook(self._keep) for r in routers]

    def _keep(self, _module, _args, out) -> None:
        if torch._C._current_graph_task_id() != -1:  # recomputed inside backward
            return
        self._logits.append(out[0] if isinstance(out, tuple) else out)

    def model_kwargs(self) -> dict:
        """Extra keyword arguments of the model's forward on this stage: a transformers
        model must not add its own (stage-local) auxiliary term on the last stage."""
        if self.is_last and self.spec["kind"] == "transformers":
            return {"output_router_logits": False}
        return {}

    def begin(self, x: torch.Tensor | None):
        """The hidden states in ``x`` (the received flat tensor; None on stage 0) and the
        sums of the earlier stages (None on stage 0). Clears the kept logits."""
        self._logits = []
        if self.is_first:
            return None, None
        ndim = int(x[-1])
        shape = [int(v) for v in x[-1 - ndim : -1]]
        dtype = _DTYPES[int(x[-2 - ndim])]
        n, e = 1, self.num_experts
        for s in shape:
            n *= s
        hidden = x[:n].view(shape).to(dtype)
        prob_sum = x[n : n + e]  # keeps its graph: d loss / d S goes back in x's gradient
        counts = x[n + e : n + 2 * e].detach()
        rows = x[n + 2 * e].detach()
        return hidden, (counts, prob_sum, rows)

    def _sums(self, start, attention_mask):
        logits, self._logits = self._logits, []
        if not logits and start is None:
            device = attention_mask.device if attention_mask is not None else None
            z = torch.zeros(self.num_experts, dtype=torch.float32, device=device)
            return z, z.clone(), torch.zeros((), dtype=torch.float32, device=device)
        if not logits:
            return start
        spec = self.spec
        if self.chunks is not None:
            attention_mask = None
        if self.sequence is not None and attention_mask is not None:
            # the routers saw this rank's sequence shard: its tokens of the mask
            attention_mask = attention_mask.chunk(self.sequence.size, dim=1)[self.sequence.rank]
        return router_sums(
            logits, spec["num_experts"], spec["top_k"], attention_mask, spec["routing"], start
        )

    def send(self, hidden: torch.Tensor, start, attention_mask) -> torch.Tensor:
        """The flat tensor a stage before the last sends on."""
        counts, prob_sum, rows = self._sums(start, attention_mask)
        prob_sum = prob_sum.to(hidden.device)
        tail = torch.tensor(
            [_DTYPES.index(hidden.dtype), *hidden.shape, hidden.dim()],
            dtype=torch.float32,
            device=hidden.device,
        )
        return torch.cat(
            [
                hidden.reshape(-1).float(),
                prob_sum,
                counts.detach().to(hidden.device),
                rows.detach().reshape(1).to(hidden.device),
                tail,
            ]
        )

    def aux(self, start, attention_mask) -> torch.Tensor:
        """The whole model's auxiliary loss of this micro-batch (last stage)."""
        counts, prob_sum, rows = self._sums(start, attention_mask)
        aux = balance_loss(counts, prob_sum, rows, self.num_experts, self.replicas, self.sequence)
        if self.chunks is not None:
            # the value of the replica's rows (the mean of the cp ranks' terms, as the cp
            # sharder averages the model's own loss over cp), the gradient of this rank's
            # term: the replica group's gradient average makes it the one-process one
            total = aux.detach().clone()
            comm.all_reduce(total, self.chunks, label="control")
            aux = aux + (total / self.chunks.size - aux.detach())
        return aux

    def discard(self) -> None:
        """Forget the kept logits (a last stage called without labels: no loss)."""
        self._logits = []

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def attach_router_aux(
    stages, model: nn.Module, replicas: Group | None, chunks: Group | None = None
) -> bool:
    """Give each stage of ``model`` (``split_model``'s ``SplitStage`` list, or this rank's
    ones) a ``StageRouterAux`` when the model's loss has a router auxiliary term; switches
    off the term the model would add from its stage-local layers. False (nothing changes)
    for a model without one."""
    spec = model_aux(model)
    if spec is None:
        return False
    replicas = replicas if replicas is not None and replicas.size > 1 else None
    # under sequence parallelism each tp rank's routers see its shard of the sequence:
    # the sums are combined over tp on the last stage (``balance_loss``'s ``sequence``)
    tp = getattr(model, "meshtrain_tp", None) or {}
    sequence = tp["group"] if tp.get("sequence_parallel") and tp["group"].size > 1 else None
    for stage in stages:
        blocks = stage.model.get_submodule(stage.blocks_path)
        stage.router_aux = StageRouterAux(
            stage_routers(blocks), spec, replicas, stage.is_first, stage.is_last, sequence, chunks
        )
        if spec["kind"] == "decoder":
            stage.model.aux_in_forward = False  # the stage's copy; the model keeps its own
    return True


__all__ = [
    "StageRouterAux",
    "attach_router_aux",
    "check_pipeline_moe",
    "model_aux",
    "stage_routers",
]

"""One part of the ZeRO stage: the parameters of one kind (the model's, or its experts')
over the ranks that hold the same copy of them, with a small lifecycle.

``ZeroStage`` (``parallel.zero.stage``) holds one part per kind and is what the Engine
calls; a model without experts is one part. Each part runs, for every micro-step and
step::

    begin_window()          first micro-step of an accumulation window
    before_backward(b)      b: is this the window's last micro-step?
    <loss.backward()>       gradient buckets reduce as they fill (GradReducer)
    after_backward()        stages 2-3: finish the reductions now (no rank keeps a full
                            gradient to accumulate into), free ZeRO-3 units
    before_step()           stages 0-1: finish the reductions (they ran on the boundary
                            backward only)
    grad_norm()             L2 norm of the reduced gradients over every shard
    step(optimizer, f)      masters get gradient x f, the optimizer steps, the updated
                            chunks are written back and their all-gathers launched
                            (stages 1-2); with overlap_param_gather each bucket is waited for just
                            before the next forward first uses it (``gather_ahead``)
    after_step()            clear gradients for the next window

and ``gathered(module)`` wherever whole parameters are needed (evaluation, export,
``module_state_dict``): a no-op below stage 3. The storage and bytes of each stage are
``meshtrain.parallel.zero.plan``'s table; the reduction is ``grad_reducer``'s; stage-3
gathering is ``stage3``'s.

Gradient pre-division (``prescale_gradients`` / ``gradient_predivide_factor``, DeepSpeed's
keys): each rank's gradients are divided by ``f`` (``dp`` with prescale) *before* the
reduction, which keeps fp16 sums in range, and the rest of the ``1 / dp`` average after
it. Gradients are linear in the loss, so the division rides on the backward's loss
multiplier (``predivide``) and the rest on the step's single scaling pass
(``grad_divisor = dp / f``): no extra pass over the gradients.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from meshtrain.distributed import comm
from meshtrain.distributed.topology import Group, Topology
from meshtrain.dtypes import PRECISIONS
from meshtrain.errors import TrainingError
from meshtrain.parallel.zero.gather_ahead import GatherAhead
from meshtrain.parallel.zero.grad_reducer import GradReducer
from meshtrain.parallel.zero.plan import build_plan, comm_bytes_theory


class ZeroPart:
    """Flat groups, gradient reducer and (stage 3) gatherer of one kind of parameters over
    one replica group, and their order (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        groups: list[dict],
        config,
        topology: Topology,
        replicas: Group | None = None,
        *,
        average_over: int | None = None,
        across: Group | None = None,
        frozen_select=None,
        overlap: bool | None = None,
    ) -> None:
        """``replicas``: the ranks holding the same copy of these parameters (reduced and
        sharded over); ``average_over``: the divisor that turns the reduced sum into the
        single-process gradient (default ``replicas.size``; expert parameters reduce over
        edp but divide by dp x cp, ``zero.stage``); ``across``: a group whose ranks hold
        *different* parameters of this kind, whose squared gradient norms add up (the ep
        group for experts); ``frozen_select``: which frozen parameters stage 3 shards here
        (default all); ``overlap``: launch reductions as buckets fill (default
        ``overlap_comm``)."""
        z = config.zero_optimization
        self.stage = int(z.stage)
        self.topology = topology
        # the ranks holding the same copy of these parameters: dp x cp for the model's
        # weights (cp ranks see other chunks of the same rows), edp for expert weights
        self.replicas = replicas = replicas or topology.replica_group
        self.across = across
        plan = build_plan(
            model, groups, config, topology, self.stage, replicas, frozen_select=frozen_select
        )
        self.per_group = plan.per_group
        self.flat_groups = plan.flat_groups
        self.gatherer = plan.gatherer
        self.frozen_groups = plan.frozen_groups  # stage 3: frozen parameters' shards
        # stage 3 under a pipeline keeps a stage whole over its run of the action list, so
        # its gradients accumulate in .grad and are reduced once after the schedule
        # (``pipeline_gather``), like stages 0-1; stage 2 (and 3 alone) every backward
        self.every_backward = self.stage == 2 or (self.stage == 3 and topology.pp_size == 1)
        self._window_reduced = False  # stages 0-1: before_step already finished the reduction
        self._reduced_once = False  # gradient storage starts unwritten (FlatGroup._init_grads)
        dp = average_over or replicas.size
        self.predivide = float(
            dp if config.prescale_gradients else config.gradient_predivide_factor
        )
        self.grad_divisor = dp / self.predivide
        comm_dtype = config.communication_data_type
        self.comm_dtype = PRECISIONS[comm_dtype] if comm_dtype else None
        names = {p: n for n, p in reversed(list(model.named_parameters()))}
        gatherer = self.gatherer
        self.reducer = GradReducer(
            self.flat_groups,
            replicas,
            overlap=bool(z.overlap_comm if overlap is None else overlap),
            comm_dtype=self.comm_dtype,
            ignore_unused=bool(z.ignore_unused_parameters),
            names=names,
            on_reduced=(lambda g, b: gatherer.release_bucket(g, b)) if gatherer else None,
        )
        # stages 1-2 (and stage 3's whole parameters): all-gathered after every step
        self.gathered_groups = [g for g in self.flat_groups if g.sharded and not g.shard_params]
        self.ahead = (
            GatherAhead(model, self.gathered_groups, replicas)
            if z.overlap_param_gather and self.gathered_groups and replicas.size > 1
            else None
        )
        self.tp_spans = None  # tensor parallelism: which gradient spans are sharded over tp
        if topology.tp_size > 1:
            from meshtrain.parallel.tensor.grad_norm import sharded_spans
            from meshtrain.parallel.tensor.sharding import sharded_parameter_ids

            self.tp_spans = sharded_spans(self.flat_groups, sharded_parameter_ids(model))

    # the lifecycle ---------------------------------------------------------------------------
    def wait_params(self) -> None:
        """Finish the parameter all-gathers the last step launched (a no-op when none)."""
        if self.ahead is not None:
            self.ahead.wait_all()

    def begin_window(self) -> None:
        self.wait_params()  # a forward that skipped some modules, or the pipeline's window
        self.reducer.begin_window()

    def before_backward(self, boundary: bool) -> None:
        self.wait_params()
        self.reducer.begin_backward(self.every_backward or boundary)

    def after_backward(self, written=()) -> None:
        """``written``: parameters whose ``.grad`` was set without autograd's accumulation
        hooks (a pipeline's ZB-H1 weight step), for the unused-parameter check."""
        if written:
            self.reducer.note_written(written)
            # full gradients (stages 0-1): into the flat buffer now, as the hook does for
            # autograd's, so the next micro-batch's ``+=`` lands in place; left until the
            # window's reduction they were a second copy of the stage's gradients (a zbv
            # rank's peak RSS 1.07x torch's on the 69M decoder, bench_pipeline)
            for g in self.flat_groups:
                for p in written:
                    g.land_grad(p)
        if self.every_backward:
            self.reducer.finish()
            self._reduced_once = True
            if self.gatherer is not None:
                self.gatherer.release_all()  # units whose parameters got no gradient

    def before_step(self) -> None:
        """Finish the window's reduction (stages 0-1; 2-3 reduced in every backward). Safe to
        call twice in a window: a gradient-norm query before the step (``clip_grad_norm_``)
        and the step itself both call it, and the buckets are reduced once."""
        if not self.every_backward and not self._window_reduced:
            self.reducer.finish()  # lands zeros for parameters that got no gradient
            self._window_reduced = True
        elif self.every_backward and not self._reduced_once:
            for g in self.flat_groups:  # a step before any backward: zero gradients
                g.zero_grad_storage()
        self._reduced_once = True

    def grad_norm(self) -> float:
        """L2 norm of the reduced gradients over every rank's owned chunks (inf/NaN if any
        overflowed); the scalar all-reduce is recorded under ``control``. Under tensor
        parallelism replicated parameters count once (``parallel.tensor.grad_norm``)."""
        return float(self.grad_square_sum().sqrt())

    def grad_square_sum(self) -> torch.Tensor:
        """Sum of squares of the reduced gradients of these parameters over every shard
        (summed over tp, the replicas when sharded, and ``across``), a 0-d fp32 tensor."""
        device = self.topology.device
        if self.tp_spans is not None:
            from meshtrain.parallel.tensor.grad_norm import local_square_sum

            chunks = [g.grad_chunks for g in self.flat_groups]
            sq = local_square_sum(chunks, self.tp_spans, self.topology.tp_size, device)
            comm.all_reduce(sq, self.topology.tp_group, label="control")
        else:
            parts = [
                torch.linalg.vector_norm(c, dtype=torch.float32)
                for g in self.flat_groups
                for c in g.grad_chunks
            ]
            sq = torch.stack(parts).pow(2).sum() if parts else torch.zeros((), device=device)
        if any(g.sharded for g in self.flat_groups):
            comm.all_reduce(sq, self.replicas, label="control")
        if self.across is not None:  # other ranks hold other parameters of this kind
            comm.all_reduce(sq, self.across, label="control")
        return sq

    # this part's gradient buffers, for the stage's contract (``parallel.zero.stage``) ------
    def scale_grads_(self, factor: float) -> None:
        """Multiply the gradient this rank holds (its chunk of every bucket) by ``factor``."""
        for g in self.flat_groups:
            for chunk in g.grad_chunks:
                chunk.mul_(factor)

    def unlink_sharded_grads(self) -> None:
        """Stage 1 after its reduction: ``p.grad`` goes (the rest of the flat buffer is not
        the global gradient, only this rank's chunk is)."""
        for g in self.flat_groups:
            if g.sharded:
                for p in g.grad_views:
                    p.grad = None

    def relink_grads(self, divide_16bit_by: float) -> None:
        """Point every ``p.grad`` at its view of the full flat buffer again, the gradients
        in a 16-bit dtype divided by ``divide_16bit_by`` (fp32 ones carry no loss scale:
        the step read them through a copy)."""
        for g in self.flat_groups:
            for p, view in g.grad_views.items():
                p.grad = view
            if divide_16bit_by != 1.0 and g.dtype != torch.float32:
                for chunk in g.grad_chunks:
                    chunk.mul_(1.0 / divide_16bit_by)

    def owned_grad_views(self, param: torch.Tensor) -> list[tuple[torch.Tensor, slice]] | None:
        """``[(view into this rank's reduced gradient chunk, slice of param.view(-1))]`` for
        the elements of ``param`` whose reduced gradient this rank holds (all of them
        unsharded, a share sharded; ``[]`` when it holds none); None when ``param`` is
        not in this part."""
        for g in self.flat_groups:
            bucket = g.bucket_of.get(param)
            if bucket is None:
                continue
            off = next(o for q, o in zip(bucket.params, bucket.offsets, strict=True) if q is param)
            n = g.shapes[param].numel()
            lo, hi = g.owned_range(bucket)
            a, z = max(off, bucket.start + lo), min(off + n, bucket.start + hi)
            if a >= z:
                return []
            chunk = g.grad_chunks[bucket.index]
            base = bucket.start + lo
            return [(chunk[a - base : z - base], slice(a - off, z - off))]
        return None

    def full_grad(self, param: torch.Tensor, divisor: float) -> torch.Tensor | None:
        """``param``'s whole reduced gradient divided by ``divisor``: stage 0 its ``.grad``
        (averaged in place already), stages 1-3 assembled in fp32 from every rank's chunk
        by one all-reduce of its size over the replicas (every rank must call it for the
        same parameter); None when ``param`` is not in this part."""
        for g in self.flat_groups:
            bucket = g.bucket_of.get(param)
            if bucket is None:
                continue
            if not g.sharded:  # stage 0: p.grad is the averaged gradient (DeepSpeed returns it)
                return param.grad
            # stages 1-3: this rank's slice of the flat bucket, the rest from their owners
            shape = g.shapes[param]
            i = next(k for k, q in enumerate(bucket.params) if q is param)
            start = bucket.offsets[i] - bucket.start  # bucket-local
            out = torch.zeros(shape.numel(), dtype=torch.float32, device=g.device)
            lo = max(start, g.rank * bucket.chunk)
            hi = min(start + shape.numel(), (g.rank + 1) * bucket.chunk)
            if hi > lo:
                chunk = g.grad_chunks[bucket.index]
                part = chunk.narrow(0, lo - g.rank * bucket.chunk, hi - lo)
                out.narrow(0, lo - start, hi - lo).copy_(part)
            comm.all_reduce(out, self.replicas, label="full_grad")
            if divisor != 1.0:
                out.mul_(1.0 / divisor)
            return out.view(shape)
        return None

    @property
    def synchronising(self) -> bool:
        """This backward reduces (not inside ``no_sync``)."""
        return self.reducer.synchronising

    @property
    def window_reduced(self) -> bool:
        """Stages 0-1: this window's gradients were already reduced (once)."""
        return self._window_reduced

    def keep_local_window(self) -> None:
        """Stage 0, a window whose backwards all ran inside ``no_sync`` and that the user
        steps (DDP's ``no_sync`` then ``optimizer.step()``: local SGD): the step uses this
        rank's own gradients, so nothing is reduced (no bytes move); parameters that got
        no gradient get zeros, as a reduction would have given them."""
        for g in self.flat_groups:
            g.land_missing_grads()
        self._window_reduced = True
        self._reduced_once = True

    def finish_window_reduction(self) -> None:
        """Stages 0-1, a synchronising backward outside the Engine's step (the
        Accelerator): wait for the overlapped buckets, launch the rest, mark it done."""
        self.reducer.finish()
        self._window_reduced = True

    def step(self, optimizer: torch.optim.Optimizer, factor: float) -> None:
        """Step the fp32 masters with gradients x ``factor``, write them back, gather."""
        self.wait_params()  # the step writes this rank's chunks, which the gathers read
        for g in self.flat_groups:
            g.load_master_grads(factor)
        optimizer.step()
        for g in self.flat_groups:
            g.release_master_grads()
            g.copy_master_to_params()
        self.gather_updated_params()

    def gather_updated_params(self) -> None:
        """Stages 1-2 (and stage 3's whole parameters): every rank updated its own chunks;
        all-gather the full buckets. Sharded ZeRO-3 parameters are gathered when used.
        With overlap the all-gathers are only launched (``gather_ahead``)."""
        if self.ahead is not None:
            self.ahead.launch()
            return
        works = []
        for g in self.gathered_groups:
            for b in g.buckets:  # in place: the input is this rank's chunk of the output
                full = b.view(g.param_flat)
                mine = b.owned(g.param_flat, g.rank)
                works.append(comm.all_gather_bucket(full, mine, self.replicas))
        for w in works:
            w.wait()

    def after_step(self) -> None:
        for g in self.flat_groups:
            g.zero_grads()
        self._window_reduced = False

    def release_module(self, module: nn.Module) -> None:
        """Leave ``module`` holding its whole parameters on this rank with no ZeRO-3 hooks
        (stages 0-2 hold them already): the end of training, when the user's model object
        must work on its own. The engine cannot step this module afterwards."""
        if self.ahead is not None:  # stages 1-2: the last step's all-gathers, and no hooks
            self.ahead.remove()  # left on the user's model (later steps gather at once)
            self.ahead = None
        if self.gatherer is None:
            return
        sharded = {id(p) for g in [*self.flat_groups, *self.frozen_groups] for p in g.params}
        with torch.no_grad(), self.gatherer.gathered():
            whole = [(p, p.data.clone()) for p in module.parameters() if id(p) in sharded]
        self.gatherer.remove()
        self.gatherer = None
        with torch.no_grad():
            for p, t in whole:
                p.data = t

    def reload_params(self) -> None:
        """After the masters were loaded (checkpoint): write them to the parameters and
        all-gather, exactly as after an optimizer step, and start a fresh window."""
        for g in self.flat_groups:
            g.copy_master_to_params()
        self.gather_updated_params()
        self.wait_params()
        self.after_step()
        self.reducer.begin_window()

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally without communicating (stages 0-1 only)."""
        if self.every_backward:
            raise TrainingError(
                f"no_sync: ZeRO stage {self.stage} reduce-scatters gradients on every "
                "backward (no rank keeps a full gradient to accumulate into); use "
                "gradient_accumulation_steps, or ZeRO stage 0/1 to accumulate locally"
            )
        with self.reducer.no_sync():
            yield

    def gathered(self, module: nn.Module | None = None):
        """Whole parameters of ``module`` (default: all) inside the block; every rank must
        enter it. Changes made inside are not kept under stage 3."""
        self.wait_params()
        return nullcontext() if self.gatherer is None else self.gatherer.gathered(module)

    # accounting ------------------------------------------------------------------------------
    @property
    def trainable_numel(self) -> int:
        return sum(g.trainable_numel for g in self.flat_groups)

    @property
    def frozen_sharded_numel(self) -> int:
        """Elements of the frozen parameters sharded under stage 3 (0 below it)."""
        return sum(g.frozen_numel for g in self.frozen_groups)

    def comm_bytes_theory(self, micro_steps: int = 1, gathers: int | None = None) -> int:
        """Bytes one optimizer step with ``micro_steps`` micro-steps records (plan table);
        ``gathers``: stage 3 under a pipeline, the all-gathers per unit this step."""
        itemsize = None if self.comm_dtype is None else self.comm_dtype.itemsize
        return comm_bytes_theory(self.flat_groups, self.stage, micro_steps, itemsize, gathers)

    def state_bytes(self) -> dict[str, int]:
        """This rank's bytes of parameters (device / host; stage 3's frozen shards
        included), gradients and fp32 masters."""
        out = {"params": 0, "params_host": 0, "grads": 0, "master": 0}
        for g in [*self.flat_groups, *self.frozen_groups]:
            b = g.state_bytes()
            out["params_host" if g.params_offloaded else "params"] += b["params"]
            out["grads"] += b["grads"]
            out["master"] += b["master"]
        if self.gatherer is not None:
            out["params"] += self.gatherer.gathered_bytes()
        return out

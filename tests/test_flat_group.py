"""FlatGroup's optimizer slices and gradient landing (meshtrain.parallel.zero.flat_group), in one
process (partitions 1: plain data parallelism's layout, no process group needed).

Every comparison is bit-exact (``torch.equal``): slicing a master chunk changes which
tensor an element-wise optimizer steps an element in, never the arithmetic on it, and
landing a gradient by copy instead of by ``0 + g`` gives the same bits.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.parallel.zero.flat_group import FlatGroup


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _grads(model: nn.Module, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


def _flat(model: nn.Module, slice_numel: int, bucket_numel: int = 1 << 30) -> FlatGroup:
    return FlatGroup(
        list(model.parameters()),
        partitions=1,
        rank=0,
        bucket_numel=bucket_numel,
        slice_numel=slice_numel,
    )


def _step(group: FlatGroup, opt: torch.optim.Optimizer, grads: list[torch.Tensor]) -> None:
    params = list(reversed(group.params))  # registration order
    for p, g in zip(params, grads, strict=True):
        group.grad_views[p].copy_(g)  # what landing the gradient does
    group.load_master_grads(1.0)
    opt.step()
    group.release_master_grads()
    group.copy_master_to_params()
    group.zero_grads()


def test_masters_are_bounded_slices_sharing_the_chunk_storage():
    model = _model()
    group = _flat(model, slice_numel=7, bucket_numel=40)
    # backward order: bias 3 + weight 21 + bias 7 | weight 35 (a parameter is never split)
    assert [b.numel for b in group.buckets] == [31, 35]
    for bucket, slices in zip(group.buckets, group.master_slices, strict=True):
        sizes = [m.numel() for m in slices]
        assert sizes == [7] * (bucket.numel // 7) + ([bucket.numel % 7] if bucket.numel % 7 else [])
        chunk = group.master_chunks[bucket.index]
        base = chunk.data_ptr()
        offsets = [m.data_ptr() - base for m in slices]
        assert offsets == [4 * 7 * i for i in range(len(slices))]  # views, in order, no copy
    assert len(group.master_params) == sum(len(s) for s in group.master_slices)


def test_sliced_adamw_is_bit_identical_to_per_parameter_adamw():
    ref_model, model = _model(), _model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    group = _flat(model, slice_numel=5)
    opt = torch.optim.AdamW(group.master_params, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(4):
        for p, g in zip(ref_model.parameters(), _grads(ref_model, step), strict=True):
            p.grad = g
        ref.step()
        _step(group, opt, _grads(model, step))
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_optimizer_state_joins_and_cuts_slices_exactly():
    """A checkpoint's view of a bucket (``optimizer_state``) put back into a fresh optimizer
    (``set_optimizer_state``) continues the run bit for bit."""
    model_a, model_b = _model(), _model()
    a, b = _flat(model_a, slice_numel=4), _flat(model_b, slice_numel=4)
    opt_a = torch.optim.AdamW(a.master_params, lr=1e-2, weight_decay=0.1, foreach=False)
    opt_b = torch.optim.AdamW(b.master_params, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(2):
        _step(a, opt_a, _grads(model_a, step))
        _step(b, opt_b, _grads(model_b, step))
    saved = {}
    for bucket in b.buckets:
        state = b.optimizer_state(bucket, opt_b.state)
        n = b.master_chunks[bucket.index].numel()
        assert state["exp_avg"].shape == (n,) and state["exp_avg_sq"].shape == (n,)
        assert float(state["step"]) == 2.0
        joined = torch.cat([opt_b.state[m]["exp_avg"] for m in b.master_slices[bucket.index]])
        assert torch.equal(state["exp_avg"], joined)
        saved[bucket.index] = {k: v.clone() for k, v in state.items()}
    fresh = torch.optim.AdamW(b.master_params, lr=1e-2, weight_decay=0.1, foreach=False)
    for bucket in b.buckets:
        b.set_optimizer_state(bucket, fresh.state, saved[bucket.index])
    steps = [fresh.state[m]["step"] for m in b.master_params]
    assert len({id(s) for s in steps}) == len(steps)  # each slice steps its own counter
    for step in range(2, 4):
        _step(a, opt_a, _grads(model_a, step))
        _step(b, fresh, _grads(model_b, step))
    for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def _reducer(group: FlatGroup):
    from meshtrain.distributed.comm import Group
    from meshtrain.distributed.comm_stats import CommStats
    from meshtrain.parallel.zero.grad_reducer import GradReducer

    dp = Group("dp", None, (0,), 0, CommStats())  # size 1: collectives are no-ops
    return GradReducer([group], dp)


def test_gradients_land_in_the_flat_buffer_without_a_memset():
    """``zero_grads`` sets ``.grad`` to None; the hook copies each fresh gradient into its
    view; a parameter that got none in the window is zeroed before the reduction; two
    backwards in a window accumulate in place; a gradient written without autograd's hooks
    (the pipeline's split backward) is copied in. All against plain autograd, bit-exact."""
    ref, model = _model(), _model()
    group = _flat(model, slice_numel=1 << 18, bucket_numel=40)
    reducer = _reducer(group)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    h = torch.randn(4, 7, generator=torch.Generator().manual_seed(2))  # the last layer's input
    first, last = list(model.children())[0], list(model.children())[2]
    ref_first, ref_last = list(ref.children())[0], list(ref.children())[2]

    group.grad_flat.fill_(123.0)  # stale values of an earlier window must never show
    group.zero_grads()
    assert all(p.grad is None for p in model.parameters())
    reducer.begin_window()
    reducer.begin_backward(True)
    model(x).square().sum().backward()  # every parameter gets a gradient
    for p in model.parameters():
        assert p.grad is group.grad_views[p]  # landed: .grad is the view again
    reducer.finish()
    ref(x).square().sum().backward()
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)

    # a window where the first layer's output is unused, accumulated over two backwards
    group.grad_flat.fill_(7.0)
    group.zero_grads()
    ref.zero_grad()
    reducer.begin_window()
    for sync in (False, True):
        reducer.begin_backward(sync)
        last(h).sum().backward()
        ref_last(h).sum().backward()
    assert first.weight.grad is None  # no hook ran for it: landed (zeroed) in finish
    reducer.finish()
    assert torch.equal(first.weight.grad, torch.zeros_like(first.weight))
    assert torch.equal(first.bias.grad, torch.zeros_like(first.bias))
    assert torch.equal(last.weight.grad, ref_last.weight.grad)
    assert torch.equal(last.bias.grad, ref_last.bias.grad)
    assert ref_first.weight.grad is None

    # written without hooks: a fresh tensor is copied in by finish
    group.zero_grads()
    reducer.begin_window()
    reducer.begin_backward(True)
    manual = torch.full_like(first.weight, 0.5)
    first.weight.grad = manual
    reducer.finish()
    assert first.weight.grad is group.grad_views[first.weight]
    assert torch.equal(first.weight.grad, manual)
    reducer.remove()


def test_whole_packing_keeps_every_parameter_inside_one_chunk():
    """``pack_whole`` (Adafactor's layout): each bucket is P equal chunks, every parameter
    lies inside exactly one, none overlap, and P = 1 gives the flat packing's offsets."""
    from meshtrain.parallel.zero.packing import pack_buckets, pack_whole

    numels = [35, 7, 21, 3, 300, 64, 64, 1, 9, 128]
    keys = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    for partitions in (1, 2, 3, 4):
        for cap, ks in ((100, None), (1 << 30, None), (100, keys)):
            packed = pack_whole(numels, cap, partitions, ks)
            assert sorted(i for _, _, m, _ in packed for i in m) == list(range(len(numels)))
            end = 0
            for start, numel, members, offsets in packed:
                assert start == end and numel % partitions == 0
                chunk = numel // partitions
                spans = sorted((o, o + numels[i]) for i, o in zip(members, offsets, strict=True))
                for (_, b), (c, _) in zip(spans, spans[1:], strict=False):
                    assert b <= c  # no overlap
                for a, b in spans:  # inside one rank's chunk
                    assert (a - start) // chunk == (b - 1 - start) // chunk
                if ks is not None:
                    assert len({ks[i] for i in members}) == 1
                end = start + numel
    flat = pack_buckets(numels, 100, 1)
    whole = pack_whole(numels, 100, 1)
    assert [(s, n, m) for s, n, m, _ in whole] == flat
    for s, _, m, offsets in whole:
        assert offsets == [s + sum(numels[j] for j in m[:k]) for k in range(len(m))]


def test_gradient_storage_starts_unwritten_with_zero_padding():
    """Full gradients start as ``.grad = None`` over an unwritten buffer whose padding
    (alignment gaps and the tail) is zero, so a reduction of a bucket never sums garbage;
    ``padding_spans`` names exactly the elements no parameter covers."""
    from meshtrain.parallel.zero.packing import padding_spans

    model = _model()
    group = FlatGroup(list(model.parameters()), partitions=3, rank=1, bucket_numel=1 << 30)
    assert all(p.grad is None for p in model.parameters())
    for b in group.buckets:
        sizes = [group.shapes[p].numel() for p in b.params]
        spans = padding_spans(b.start, b.numel, b.offsets, sizes)
        assert sum(hi - lo for lo, hi in spans) == b.numel - sum(sizes)
        for lo, hi in spans:
            assert torch.count_nonzero(group.grad_flat[lo:hi]) == 0
    assert padding_spans(10, 20, [10, 15], [3, 5]) == [(13, 15), (20, 30)]

"""Chunked (fused linear) cross-entropy: the LM head and the loss, ``chunk`` tokens at a time.

For ``N`` tokens with hidden states ``h [N, H]``, an LM head ``W [V, H]`` and targets
``t``, the plain path builds ``logits = h W^T`` (``[N, V]``; at ``N = 4096`` tokens and a
152k vocabulary, 2.5 GB in fp32), keeps it for backward and builds the softmax gradient
of the same size. Here tokens go through in chunks of ``C`` rows: each chunk's logits
``[C, V]`` (fp32), its loss, and at once its gradients

    dL/dz = (softmax(z) - onehot(t)) / n          n = non-ignored targets
    dL/dh_c = dL/dz W        dL/dW += (dL/dz)^T h_c

so forward keeps ``dL/dh [N, H]`` and ``dL/dW [V, H]`` (the size of the weight, which the
plain path's weight gradient also has) and never more than one ``[C, V]`` block. Backward
multiplies them by the incoming scalar: the same arithmetic as the plain path, summed in
another order (fp32: agrees to ~1e-7 relative). Without autograd (evaluation) only the
loss is computed. This is Liger-Kernel's fused-linear-cross-entropy scheme in plain torch.

Vocab-parallel (``group``: the tensor-parallel group, ``W`` this rank's ``[V / T, H]``
rows, ``vocab_start`` its first token id): each chunk all-reduces its row max (MAX) and
its ``sum exp`` and target logit (SUM, one call) over the group, as
``parallel.tensor.cross_entropy`` does for whole logits; ``dL/dh`` is a sum over the
vocabulary shards, so it is all-reduced once (``N H`` floats) at the end. Bytes per call:
``24 N`` (statistics) + ``4 N H`` (the hidden gradient); no rank holds ``[N, V]``.
"""

from __future__ import annotations

import torch

from meshtrain.errors import ConfigError


def _stats_allreduce(group, tensor, op):
    if group is not None:
        from meshtrain.distributed import comm

        comm.all_reduce(tensor, group, op=op)


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, chunk, ignore_index, group, vocab_start, vocab_size):
        from meshtrain.distributed.comm import ReduceOp

        n_tok, v_local = hidden.shape[0], weight.shape[0]
        valid = target != ignore_index
        count = valid.sum().clamp(min=1).to(torch.float32)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden, dtype=torch.float32) if need_grad else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        w32 = weight.float()
        real = max(0, min(v_local, vocab_size - vocab_start))  # padded columns are masked
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for lo in range(0, n_tok, chunk):
            h = hidden[lo : lo + chunk].float()
            t, ok = target[lo : lo + chunk], valid[lo : lo + chunk]
            z = h @ w32.t()  # [C, V_local]: the only vocabulary-sized block alive
            if real < v_local:
                z[:, real:] = float("-inf")
            m = z.max(dim=1).values
            _stats_allreduce(group, m, ReduceOp.MAX)
            z -= m.unsqueeze(1)
            mine = ok & (t >= vocab_start) & (t < vocab_start + v_local)
            local_t = (t - vocab_start).masked_fill(~mine, 0)
            picked = z.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
            z.exp_()
            sums = torch.stack((picked, z.sum(dim=1)))
            _stats_allreduce(group, sums, ReduceOp.SUM)
            loss = (sums[1].log() - sums[0]).masked_fill(~ok, 0.0)
            total += loss.sum()
            if need_grad:
                z /= sums[1].unsqueeze(1)  # softmax
                rows = torch.arange(z.shape[0], device=z.device)
                z[rows, local_t] -= mine.to(z.dtype)
                z *= (ok.to(z.dtype) / count).unsqueeze(1)  # dL/dz of the mean loss
                grad_h[lo : lo + chunk] = z @ w32
                if grad_w is not None:
                    grad_w.addmm_(z.t(), h)
        if grad_h is not None and group is not None:
            _stats_allreduce(group, grad_h, ReduceOp.SUM)  # dL/dh sums over vocab shards
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total / count

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gh = (grad_h * grad_out).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        gw = (grad_w * grad_out).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    group=None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, target, ignore_index=...)`` (mean over the
    non-ignored targets) without building the ``[tokens, vocab]`` logits (module docstring).

    ``hidden``: ``[..., H]``; ``weight``: ``[V, H]`` (the LM head, bias-free; under tensor
    parallelism this rank's rows, with ``group`` the tensor-parallel group,
    ``vocab_start`` its first token id and ``vocab_size`` the real vocabulary);
    ``target``: ``[...]`` token ids. Backward gives ``hidden`` and ``weight`` their exact
    gradients (computed chunk by chunk during forward).
    """
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ConfigError(f"loss.chunk_size: must be an integer >= 1, got {chunk_size!r}")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1).to(h.device)
    if t.numel() != h.shape[0]:
        raise ValueError(f"target has {t.numel()} tokens, hidden {h.shape[0]}")
    vocab = weight.shape[0] + vocab_start if vocab_size is None else vocab_size
    return _ChunkedCE.apply(h, weight, t, chunk_size, ignore_index, group, vocab_start, vocab)

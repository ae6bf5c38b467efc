"""Activation memory per rank: the formula (``meshtrain.estimate.activations``) against
what autograd keeps for the backward (``activation_probe.SavedBytes``), on meshtrain's
Decoder in fp32 on CPU, at cp 1 and, with all-to-all attention on real gloo ranks, at
cp 2 and 4.

The main measure is the bytes of the distinct storages saved for the backward at the end
of the forward (see ``activation_probe`` for why not RSS): deterministic, so the formula is
held to 10% (the issue's bar) and is in fact within 0.1% (a few scalars are not counted).
Falling as 1/C: measured bytes at cp 1 over those at cp C lie within [0.9 C, 1.1 C].
The peak of a whole forward + backward (``peak_activation_bytes``) is checked once, at
4096 tokens and cp 2, against the RSS high-water mark's growth over one step (reset after a
warm-up step; ranks run with a fixed malloc mmap threshold so freed blocks leave RSS):
within 10%; measured within 1% at 8k and 16k by benchmarks/bench_context_parallel.py.
"""

from __future__ import annotations

import pytest

from tests.harness import run_ranks

DIMS = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_dim=172)
L = 1024
PEAK_L = 4096
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


class _Ulysses:
    """The Decoder's attention seam over ``group`` with all-to-all attention."""

    def __init__(self, group) -> None:
        self.group = group

    def attend(self, q, k, v, *, document_ids=None, scale=None):
        from meshtrain.parallel.context.all_to_all import ulysses_attention

        return ulysses_attention(q, k, v, self.group, document_ids=document_ids, scale=scale)


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith(field))


def _measure(group, batch: int = 1, length: int = L, peak: bool = False) -> tuple:
    """(saved bytes, formula bytes) of one Decoder forward on this rank's chunks; with
    ``peak`` also (peak RSS growth of a forward + backward, the peak formula)."""
    import torch

    from meshtrain.estimate.activation_probe import SavedBytes
    from meshtrain.estimate.activations import (
        DecoderDims,
        activation_bytes,
        peak_activation_bytes,
    )
    from meshtrain.models import Decoder, DecoderConfig

    cp = 1 if group is None else group.size
    rank = 0 if group is None else group.rank
    L = length
    model = Decoder(DecoderConfig(**DIMS, max_seq_len=L))
    ids = torch.randint(
        0, DIMS["vocab_size"], (batch, L), generator=torch.Generator().manual_seed(0)
    )
    pos = torch.arange(L).expand(batch, L)
    if cp > 1:
        for layer in model.layers:
            layer.attn.context = _Ulysses(group)
        # this rank's chunks rank and 2C-1-rank, with their global positions
        sel = torch.cat([torch.arange(L).chunk(2 * cp)[c] for c in (rank, 2 * cp - 1 - rank)])
        ids, pos = ids[:, sel], pos[:, sel]
    if peak:  # a warm-up step, then the high-water mark reset (Linux clear_refs)
        import ctypes

        # every block of 64 KiB or more its own mapping, unmapped when freed: RSS then
        # follows the bytes alive (glibc's adaptive threshold keeps freed blocks resident)
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 65536)
        model(ids, labels=ids, position_ids=pos).backward()
        model.zero_grad(set_to_none=True)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _rss("VmRSS")
    with SavedBytes([*model.parameters(), *model.buffers()]) as probe:
        loss = model(ids, labels=ids, position_ids=pos)
    dims = DecoderDims.of(model)
    est = activation_bytes(dims, seq_len=L, cp=cp, batch=batch, width=4, position_ids=True)
    if not peak:
        return probe.bytes, est
    loss.backward()
    grown = _rss("VmHWM") - base
    return (
        probe.bytes,
        est,
        grown,
        peak_activation_bytes(dims, seq_len=L, cp=cp, batch=batch, width=4, position_ids=True),
    )


def _ranks() -> dict:
    from meshtrain.distributed.topology import Topology

    cp4, cp2 = Topology(cp=4), Topology(cp=2)  # cp2: dp 2 x cp 2
    return {
        4: _measure(cp4.cp_group),
        2: _measure(cp2.cp_group),
        "peak": _measure(cp2.cp_group, length=PEAK_L, peak=True),
    }


def test_formula_matches_saved_bytes_at_cp1():
    measured, est = _measure(None, batch=2)
    assert abs(measured - est) / measured < 0.10
    assert abs(measured - est) <= 64  # in fact: only a scalar or two are not counted


def test_falls_as_one_over_cp():
    one, _ = _measure(None)
    results = run_ranks(_ranks, 4)
    for res in results:
        saved, est, grown, peak = res.pop("peak")
        assert abs(saved - est) / saved < 0.10
        assert abs(grown - peak) / peak < 0.10, (grown, peak)  # issue 29's bar
        for cp, (measured, est) in res.items():
            assert abs(measured - est) / measured < 0.10, (cp, measured, est)
            assert 0.9 * cp <= one / measured <= 1.1 * cp, (cp, one, measured)


def test_document_mask_term_does_not_fall():
    from meshtrain.estimate.activations import DecoderDims, activation_bytes

    dims = DecoderDims(hidden=64, heads=4, kv_heads=4, ffn=172, vocab=256, layers=2)
    plain = [activation_bytes(dims, seq_len=8192, cp=c) for c in (1, 2, 4)]
    masked = [activation_bytes(dims, seq_len=8192, cp=c, documents=True) for c in (1, 2, 4)]
    mask = [m - p for m, p in zip(masked, plain, strict=True)]
    assert mask == [2 * 4 * 8192 * 8192] * 3  # w B L^2 per layer on every rank
    with pytest.raises(ValueError, match="not divisible by cp"):
        activation_bytes(dims, seq_len=10, cp=4)


def test_cli_table_and_step_log(capsys):
    from types import SimpleNamespace

    import torch

    from meshtrain.cli import main
    from meshtrain.engine.step_log import StepLog
    from meshtrain.estimate.activations import (
        DecoderDims,
        activation_bytes,
        attach_activations,
    )
    from meshtrain.models import Decoder, DecoderConfig

    spec = "decoder:dim=64,n_layers=2,n_heads=4,ffn_dim=172,vocab_size=256"
    assert main(["estimate", "--model", spec, "--cp", "4", "--seq-len", "16384",
                 "--precision", "fp32"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    dims = DecoderDims(hidden=64, heads=4, kv_heads=4, ffn=172, vocab=256, layers=2)
    row = next(x for x in out.splitlines() if x.split()[:2] == ["16,384", "kept"]).split()
    assert len(row) == 2 + 2 * 3  # cp=1, 2, 4: "0.213 GB" each
    gb = [float(v) for v in row[2::2]]
    for c, shown in zip((1, 2, 4), gb, strict=True):
        want = activation_bytes(dims, seq_len=16384, cp=c, position_ids=c > 1) / 1e9
        assert abs(shown - want) / want < 5e-3  # three significant digits
    assert main(["estimate", "--params", "7B", "--cp", "2"]) == 0
    assert "give --model" in capsys.readouterr().out

    # the step log: attached for a plain decoder, shown per rank for the last batch
    model = Decoder(DecoderConfig(**DIMS, max_seq_len=L))
    log = StepLog(every=0, dp_size=1, is_logging_rank=False)
    topo = SimpleNamespace(tp_size=1, pp_size=1, cp_size=2)
    cfg = SimpleNamespace(activation_checkpointing=SimpleNamespace(enabled=False))
    assert attach_activations(log, model, topo, cfg, torch.float32)
    log.count_batch((torch.zeros(3, 512, dtype=torch.long),), {})
    log.add_loss(torch.tensor(1.0))
    last = log.end_step(step=1, lr=0.1, loss_scale=1.0, grad_norm=None, comm_bytes=0, skipped=False)
    want = activation_bytes(DecoderDims.of(model), seq_len=1024, cp=2, batch=3, position_ids=True)
    assert last["activation_bytes"] == want
    assert f"act {want / 1e6:.1f} MB/rank" in log.format(last)
    split = SimpleNamespace(tp_size=2, pp_size=1, cp_size=1)
    assert not attach_activations(StepLog(0, 1, False), model, split, cfg, torch.float32)


def test_formula_in_bf16():
    """The 16-bit terms (norms and rotary keep fp32 copies, the loss fp32 log-probs)."""
    import torch

    from meshtrain.estimate.activation_probe import SavedBytes
    from meshtrain.estimate.activations import DecoderDims, activation_bytes
    from meshtrain.models import Decoder, DecoderConfig

    model = Decoder(DecoderConfig(**DIMS, max_seq_len=512)).to(torch.bfloat16)
    ids = torch.randint(0, DIMS["vocab_size"], (2, 512), generator=torch.Generator().manual_seed(1))
    with SavedBytes([*model.parameters(), *model.buffers()]) as probe:
        model(ids, labels=ids)
    est = activation_bytes(DecoderDims.of(model), seq_len=512, batch=2, width=2)
    assert abs(probe.bytes - est) <= 64, (probe.bytes, est)


class _Attend:
    """The Decoder's attention seam with ``fn(q, k, v, group, ...)`` over ``group``."""

    def __init__(self, fn, group) -> None:
        self.fn, self.group = fn, group

    def attend(self, q, k, v, *, document_ids=None, scale=None):
        return self.fn(q, k, v, self.group, document_ids=document_ids, scale=scale)


def _terms(length: int) -> dict:
    """(saved, formula) per method and with/without packed documents, this rank."""
    import importlib

    import torch

    from meshtrain.distributed.topology import Topology
    from meshtrain.estimate.activation_probe import SavedBytes
    from meshtrain.estimate.activations import DecoderDims, activation_bytes
    from meshtrain.models import Decoder, DecoderConfig
    from meshtrain.parallel.context.all_to_all import ulysses_attention

    g = Topology(cp=2).cp_group
    fns = {"all_to_all": ulysses_attention}
    try:  # the ring lives beside this module (parallel/context/ring.py) once merged
        fns["ring"] = importlib.import_module("meshtrain.parallel.context.ring").ring_attention
    except ImportError:
        pass
    sel = torch.cat([torch.arange(length).chunk(4)[c] for c in (g.rank, 3 - g.rank)])
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(0))[:, sel]
    pos = torch.arange(length)[None][:, sel]
    out = {}
    for method, fn in fns.items():
        for docs in (False, True):
            model = Decoder(DecoderConfig(**DIMS, max_seq_len=length))
            for layer in model.layers:
                layer.attn.context = _Attend(fn, g)
            d = (pos // (length // 3)) if docs else None  # three documents, global ids
            with SavedBytes([*model.parameters(), *model.buffers()]) as probe:
                model(ids, labels=ids, position_ids=pos, document_ids=d)
            est = activation_bytes(
                DecoderDims.of(model), seq_len=length, cp=2, width=4, method=method,
                position_ids=True, documents=docs,
            )  # fmt: skip
            out[method, docs] = (probe.bytes, est)
    return out


def test_document_mask_and_ring_terms():
    """all_to_all with packed rows keeps the dense [B, 1, L, L] mask per layer on every
    rank; ring keeps only its own key/value block (the others go around again in the
    backward). Within 1% (measured:
    exact but for a few KiB of int64 ids and labels; the issue's bar is 10%)."""
    for res in run_ranks(_terms, 2, 2048):
        for key, (measured, est) in res.items():
            assert abs(measured - est) / measured < 1e-2, (key, measured, est)
        plain, masked = res["all_to_all", False][0], res["all_to_all", True][0]
        assert masked - plain >= 2 * 4 * 2048 * 2048  # the mask term did not fall with C

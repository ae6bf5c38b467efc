"""Padding-free packing (``meshtrain.data.packing``, ``meshtrain.models.packed_batches``).

* The collator equals transformers' ``DataCollatorWithFlattening`` on the same features
  (keys, values, dtypes; every option).
* Row plans: every token placed once, rows never longer than ``seq_len``, TRL's bfd
  example, order kept by greedy.
* Parity, fp32: a packed batch gives the same per-document losses and gradients as the
  same documents one per row, on meshtrain's Decoder and tiny transformers Llama, GPT-2
  (and the other verified families' logits). Tolerances (``tests/tolerance.py``): losses
  and logits within ``evaluation()``, gradients within ``gradient()``, relative normwise:
  the packed row runs SDPA with an explicit block-diagonal mask over a longer row, so the
  matmuls and softmax sums have other shapes and blockings than the one-document rows, and
  fp32 rounding (2^-24 ~ 6e-8 relative per operation) differs by a few ulps; nothing else
  differs.
* Boundary: changing one document leaves every output of the other documents of the row
  bit for bit unchanged (masked keys get weight exactly 0, and adding exact zeros
  changes no sum).
* transformers' own behaviour that ``check_packed_batch`` exists for: with the default
  cache or an all-ones attention mask, transformers 5.24 lets documents see each other.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshtrain.data.packing import (
    FlatteningCollator,
    PackedDataset,
    is_packed,
    plan_rows,
    stack_rows,
)
from meshtrain.errors import ConfigError, DataError
from meshtrain.models import Decoder, DecoderConfig
from meshtrain.models.packed_batches import PACKING_FAMILIES, check_packed_batch
from tests.tolerance import check, evaluation, gradient, relative

VOCAB = 64
LENGTHS = (5, 9, 3, 7, 1, 6)
OUT, GRAD = evaluation(), gradient()  # module docstring


def _docs(lengths=LENGTHS, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


# -- the collator -----------------------------------------------------------------------------
FEATURE_SETS = {
    "lists": [{"input_ids": [5, 6, 7]}, {"input_ids": [8]}, {"input_ids": [9, 10, 11, 12]}],
    "tensors_with_labels": [
        {"input_ids": torch.tensor([1, 2, 3, 4]), "labels": torch.tensor([-100, -100, 3, 4])},
        {"input_ids": torch.tensor([5, 6]), "labels": torch.tensor([5, 6])},
    ],
    "with_empty": [{"input_ids": [1, 2]}, {"input_ids": []}, {"input_ids": [3, 4, 5]}],
}
OPTIONS = [
    {},
    {"return_seq_idx": True, "return_flash_attn_kwargs": True},
    {"separator_id": -1, "position_ids_start": 2},
    {"return_position_ids": False},
]


@pytest.mark.parametrize("features", list(FEATURE_SETS), ids=list(FEATURE_SETS))
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "defaults")
@pytest.mark.parametrize("kind", ["pt", "np"])
def test_collator_matches_transformers(features, options, kind):
    from transformers import DataCollatorWithFlattening

    feats = FEATURE_SETS[features]
    ours = FlatteningCollator(**options, return_tensors=kind)(feats)
    theirs = DataCollatorWithFlattening(**options, return_tensors=kind)(feats)
    assert list(ours) == list(theirs)
    for key in theirs:
        a, b = ours[key], theirs[key]
        if isinstance(b, int):
            assert type(a) is int and a == b, key
        else:
            assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape, key
            assert (np.asarray(a) == np.asarray(b)).all(), key


def test_collator_call_overrides_and_empty_batch():
    from transformers import DataCollatorWithFlattening

    feats = FEATURE_SETS["lists"]
    ours = FlatteningCollator()(feats, separator_id=-7)
    theirs = DataCollatorWithFlattening()(feats, separator_id=-7)
    assert torch.equal(ours["labels"], theirs["labels"])
    with pytest.raises(DataError, match="every example of the batch is empty"):
        FlatteningCollator()([{"input_ids": []}])
    with pytest.raises(DataError, match="return_tensors"):
        FlatteningCollator(return_tensors="tf")


# -- row plans --------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["greedy", "bfd"])
@pytest.mark.parametrize("overflow", ["split", "truncate"])
def test_plan_places_every_token_once(strategy, overflow):
    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 40, size=200)
    rows = plan_rows(lengths, 16, strategy=strategy, overflow=overflow)
    placed: dict[int, list[tuple[int, int]]] = {}
    for row in rows:
        assert 0 < sum(b - a for _, a, b in row) <= 16
        for doc, a, b in row:
            placed.setdefault(doc, []).append((a, b))
    for doc, n in enumerate(lengths):
        want = [] if n == 0 else ([(0, min(n, 16))] if overflow == "truncate" else None)
        got = sorted(placed.get(doc, []))
        if want is None:  # split: contiguous 16-token pieces covering the document
            want = [(s, min(s + 16, n)) for s in range(0, n, 16)]
        assert got == want, doc
    if strategy == "greedy":  # document order kept
        order = [doc for row in rows for doc, _, _ in row]
        assert order == sorted(order)


def test_bfd_matches_trl_example_and_beats_greedy():
    # TRL's pack_dataset docstring: lengths 5, 2, 3, 1 at seq_length 4, "bfd" (truncating)
    rows = plan_rows([5, 2, 3, 1], 4, strategy="bfd", overflow="truncate")
    assert [[b - a for _, a, b in row] for row in rows] == [[4], [3, 1], [2]]
    lengths = np.random.default_rng(0).integers(1, 60, size=300)
    assert len(plan_rows(lengths, 64, strategy="bfd")) < len(plan_rows(lengths, 64))
    with pytest.raises(DataError, match="packing strategy"):
        plan_rows([3], 4, strategy="first_fit")
    with pytest.raises(DataError, match="seq_len"):
        plan_rows([3], 0)


def test_packed_dataset_rows():
    docs = _docs()
    feats = [{"input_ids": d} for d in docs]
    ds = PackedDataset(feats, 12, pad_token_id=0)
    # greedy: [5] [9 3] [7 1] [6] -> rows [5+pad7], [9+3], [7+1+pad4], [6+pad6]
    assert [[d for d, _, _ in r] for r in ds.rows] == [[0], [1, 2], [3, 4], [5]]
    row = ds[2]
    assert row["position_ids"].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 0, 1, 2, 3]
    assert row["input_ids"][:7].tolist() == docs[3].tolist()
    assert row["input_ids"][7] == docs[4][0] and row["input_ids"][8:].tolist() == [0] * 4
    assert row["labels"].tolist() == [-100, *docs[3][1:].tolist(), -100, -100, -100, -100, -100]
    batch = stack_rows([ds[i] for i in range(len(ds))])
    assert batch["input_ids"].shape == (4, 12)
    # label items (the Trainer's num_items_in_batch count): len - 1 per document, as for
    # the documents one per row; the flattened batch counts the same
    from meshtrain.trainer.loss import label_items

    items = sum(n - 1 for n in LENGTHS)
    assert label_items(batch, ["labels"], shift=True) == items
    flat = FlatteningCollator()(feats)
    assert label_items(flat, ["labels"], shift=True) == items
    stats = ds.stats()
    assert stats == {"documents": 6, "rows": 4, "real_tokens": sum(LENGTHS), "slots": 48}
    # per-token labels of the source (a chat prompt masked) are kept, the first one -100
    masked = [{"input_ids": d, "labels": torch.cat([torch.full((2,), -100), d[2:]])} for d in docs]
    row = PackedDataset(masked, 12)[1]
    assert row["labels"][:9].tolist() == [-100, -100, *docs[1][2:].tolist()]
    assert row["labels"][9:].tolist() == [-100, -100, *docs[2][2:].tolist()]


def test_packed_dataset_over_token_store(tmp_path):
    from meshtrain.data.prepare_store import prepare
    from meshtrain.data.store import TokenStore

    texts = ["abc", "hello world", "x", "packing rows", "tail"]
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(texts) + "\n", encoding="utf-8")
    prepare(str(src), "byte", tmp_path / "store", seq_len=8, pack=True, workers=1, progress=False)
    store = TokenStore(tmp_path / "store")
    ds = PackedDataset(store, 8)
    seen = []
    for i in range(len(ds)):
        row = ds[i]
        for doc, a, b in ds.rows[i]:
            seen.append((doc, a, b))
        assert row["input_ids"].shape == (8,)
    # every document (text + EOS) placed, the 12- and 13-token ones split at 8
    assert sorted(seen) == sorted(
        (d, s, min(s + 8, n))
        for d, n in enumerate(len(t) + 1 for t in texts)
        for s in range(0, n, 8)
    )
    first = ds[0]
    assert first["input_ids"][:4].tolist() == store.doc(0).astype(np.int64).tolist()


# -- models -----------------------------------------------------------------------------------
def _decoder():
    cfg = DecoderConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=32)
    return Decoder(cfg)


def _llama(**kw):
    from tests.tiny_models import tiny_llama

    return tiny_llama(seed=1, attn_implementation="sdpa", **kw)


def _gpt2():
    import transformers

    torch.manual_seed(2)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


MODELS = {"decoder": _decoder, "llama": _llama, "gpt2": _gpt2}


def _logits(model, batch):
    batch = check_packed_batch(model, batch)
    out = model(**{k: v for k, v in batch.items() if k != "labels"})
    return out if isinstance(out, torch.Tensor) else out.logits


def _token_losses(logits, labels):
    """[B, T-1] next-token losses, 0 where the label is -100."""
    return F.cross_entropy(
        logits[:, :-1].transpose(1, 2).float(), labels[:, 1:], ignore_index=-100, reduction="none"
    )


def _packed_run(model, batch, spans):
    """Per-document losses of a packed batch and the gradient of their token-sum / N."""
    model.zero_grad()
    tok = _token_losses(_logits(model, batch), batch["labels"])
    n_items = int(batch["labels"][:, 1:].ne(-100).sum())
    (tok.sum() / n_items).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    losses = [tok[r, a : b - 1].sum() / (b - a - 1) for r, a, b in spans]
    return torch.stack(losses).detach(), grads


def _one_per_row(model, docs):
    model.zero_grad()
    total, losses = 0.0, []
    n_items = sum(len(d) - 1 for d in docs)
    for d in docs:
        tok = _token_losses(_logits(model, {"input_ids": d[None]}), d[None])
        total = total + tok.sum()
        losses.append(tok.sum() / (len(d) - 1))
    (total / n_items).backward()
    return torch.stack(losses).detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _spans(position_ids):
    """(row, start, stop) of every document with at least 2 tokens, in row order."""
    out = []
    for r, row in enumerate(position_ids.tolist()):
        starts = [i for i, p in enumerate(row) if p == 0] + [len(row)]
        out += [(r, a, b) for a, b in zip(starts, starts[1:], strict=False) if b - a > 1]
    return out


def _close(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_losses_and_gradients_equal_one_document_per_row(name):
    """Both packing shapes (one flattened row; fixed rows with a padded tail) against the
    documents one per row (module docstring)."""
    model = MODELS[name]().float()
    docs = [d for d in _docs() if len(d) > 1]  # a 1-token document has no label item
    ref_losses, ref_grads = _one_per_row(model, docs)
    flat = FlatteningCollator()([{"input_ids": d} for d in docs])
    packed = PackedDataset([{"input_ids": d} for d in docs], 16)
    rows = stack_rows(list(packed))
    row_spans = []
    for r, row in enumerate(packed.rows):  # the plan's documents, not the padded tails
        at = 0
        for _, a, b in row:
            row_spans.append((r, at, at + b - a))
            at += b - a
    assert rows["input_ids"].shape == (2, 16)  # [5 9 +2 padding] [3 7 6]
    for batch, spans in ((flat, _spans(flat["position_ids"])), (rows, row_spans)):
        losses, grads = _packed_run(model, batch, spans)
        check(f"{name} per-document losses", relative(losses, ref_losses), OUT)
        for key, g in grads.items():
            check(f"{name} gradient of {key}", relative(g, ref_grads[key]), GRAD)
        assert any(g.abs().max() > 0 for g in grads.values())


@pytest.mark.parametrize("name", list(MODELS))
def test_changing_a_document_leaves_its_neighbours_exactly(name):
    model = MODELS[name]().float().eval()
    docs = _docs()
    changed = list(docs)
    changed[1] = (docs[1] + 7) % (VOCAB - 1) + 1  # same length, other tokens
    with torch.no_grad():
        a = _logits(model, FlatteningCollator()([{"input_ids": d} for d in docs]))
        b = _logits(model, FlatteningCollator()([{"input_ids": d} for d in changed]))
    lo, hi = LENGTHS[0], LENGTHS[0] + LENGTHS[1]
    assert torch.equal(a[:, :lo], b[:, :lo]) and torch.equal(a[:, hi:], b[:, hi:])
    assert not torch.equal(a[:, lo:hi], b[:, lo:hi])  # the changed document did move


def _family(model_type):
    import transformers

    torch.manual_seed(4)
    sizes = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, head_dim=8,
    )  # fmt: skip
    names = {
        "llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral",
        "gemma": "Gemma", "olmo": "Olmo", "gpt_neox": "GPTNeoX",
    }  # fmt: skip
    if model_type == "gpt2":
        return _gpt2()
    cfg = getattr(transformers, f"{names[model_type]}Config")(**sizes)
    cfg._attn_implementation = "sdpa"
    return getattr(transformers, f"{names[model_type]}ForCausalLM")(cfg)


@pytest.mark.parametrize("model_type", sorted(PACKING_FAMILIES))
def test_every_verified_family_masks_packed_documents(model_type):
    """PACKING_FAMILIES is what this test proves: packed logits = one document per row."""
    model = _family(model_type).float().eval()
    assert model.config.model_type == model_type
    docs = _docs((5, 9, 3))
    with torch.no_grad():
        packed = _logits(model, FlatteningCollator()([{"input_ids": d} for d in docs]))[0]
        ref = torch.cat([_logits(model, {"input_ids": d[None]})[0] for d in docs])
    check(f"{model_type} logits", relative(packed, ref), OUT)


def test_transformers_needs_the_guard():
    """Why ``check_packed_batch`` exists (transformers 5.24): with the config's default
    cache, or an all-ones attention mask, documents see each other."""
    model = _llama().eval()
    docs = _docs((5, 9))
    batch = FlatteningCollator()([{"input_ids": d} for d in docs])
    with torch.no_grad():
        ref = torch.cat([model(input_ids=d[None]).logits[0] for d in docs])
        raw = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        ones = model(**{**batch, "attention_mask": torch.ones_like(batch["input_ids"])})
        guarded = _logits(model, {**batch, "attention_mask": torch.ones_like(batch["input_ids"])})
    assert model.config.use_cache is True
    assert _close(raw, ref) > 1e-3 and _close(ones.logits[0], ref) > 1e-3
    check("guarded logits", relative(guarded[0], ref), OUT)


def test_check_packed_batch_refusals():
    import transformers

    batch = FlatteningCollator()([{"input_ids": d} for d in _docs((4, 5))])
    llama = _llama()
    out = check_packed_batch(llama, batch)
    assert out["use_cache"] is False and "use_cache" not in batch
    with pytest.raises(ConfigError, match="use_cache=True"):
        check_packed_batch(llama, {**batch, "use_cache": True})
    padded = {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}
    padded["attention_mask"][0, -1] = 0
    with pytest.raises(ConfigError, match="attention_mask with padding"):
        check_packed_batch(llama, padded)
    opt = transformers.OPTForCausalLM(
        transformers.OPTConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
            num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16,
        )
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"OPTForCausalLM \(model_type 'opt'\)"):
        check_packed_batch(opt, batch)
    unpacked = {"input_ids": batch["input_ids"], "position_ids": torch.arange(9)[None]}
    assert check_packed_batch(opt, unpacked) is unpacked  # one document: nothing to check
    assert check_packed_batch(_decoder(), batch) is batch  # masks from position_ids itself
    shifted = FlatteningCollator(position_ids_start=1)([{"input_ids": d} for d in _docs((4, 5))])
    with pytest.raises(ConfigError, match="restarts at 0"):
        check_packed_batch(_decoder(), shifted)
    assert is_packed(batch["position_ids"]) and not is_packed(unpacked["position_ids"])


def test_trainer_padding_free_and_use_cache(tmp_path):
    """TRL's ``padding_free``: the flattening collator when none is given, transformers'
    own accepted, a padding collator refused by name; ``model.config.use_cache`` set from
    ``use_cache`` (False) at init, as transformers' Trainer does."""
    from transformers import DataCollatorWithFlattening, DataCollatorWithPadding

    from meshtrain import Trainer, TrainingArguments
    from tests.trainer.test_transformers_model import _tokenizer

    model = _llama()
    assert model.config.use_cache is True
    args = TrainingArguments(str(tmp_path), padding_free=True)
    trainer = Trainer(model, args)
    assert isinstance(trainer.data_collator, FlatteningCollator)
    assert model.config.use_cache is False
    theirs = DataCollatorWithFlattening()
    assert Trainer(model, args, data_collator=theirs).data_collator is theirs
    with pytest.raises(ConfigError, match="padding_free=True with data_collator=DataCollatorWith"):
        Trainer(model, args, data_collator=DataCollatorWithPadding(_tokenizer(str(tmp_path))))
    with pytest.raises(ConfigError, match="padding_free"):
        TrainingArguments(str(tmp_path), padding_free="yes")

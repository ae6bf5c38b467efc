"""``meshtrain.zero.Init`` and ``GatheredParameters`` at 2 ranks (gloo, real processes).

One process group checks, in order:

* construction: while the model is being built, every parameter of every module already
  constructed holds only its shard (``numel() == 0``, ``ds_tensor`` of ``ceil(n / 2)``
  elements); after it, the rank's local elements are exactly the sum of the shards;
* values: gathered, the partitioned parameters equal the same model built normally with
  the same seed, exactly (same constructors, same random stream, sliced);
* ``GatheredParameters(modifier_rank=0)`` before the engine: a change made on rank 0
  only lands in rank 1's shard;
* training: ZeRO-3 engines over the Init-built model and over the normally built one
  (with a frozen parameter, optimizer offload so the fp32 masters are a separate copy,
  persistence threshold 0 and a 60-element one so both the sharded and the whole flat
  layouts take partitioned parameters) end at exactly the same parameters: both run the
  same fp32 operations in the same order (``tests/tolerance.py``, case 1);
* ``GatheredParameters(modifier_rank=0)`` on the engine's parameters: rank 0's change is
  in every rank's shard and in the masters (the next step starts from it on both engines,
  which stay equal), and a stage-2 engine built from an Init-built model matches too;
* the reference decoder (which initialises its children's weights after building them)
  gets the same values under Init as outside it; so do a transformers GPT-2 (post_init
  initialises its children) and a Llama loaded with ``from_pretrained`` inside the
  context, exactly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tests.harness import run_ranks

VOCAB, DIM = 50, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x):
        return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))


class Net(nn.Module):
    """Embedding, two blocks, head; ``check`` asserts the shards while constructing."""

    def __init__(self, check: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList()
        for _ in range(2):
            self.blocks.append(Block())
            if check:
                _assert_sharded(self)  # everything built so far holds only its shard
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x)
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def _assert_sharded(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        assert p.numel() == 0, f"{name} holds {p.numel()} elements during construction"
        assert p.ds_tensor.numel() == math.ceil(p.ds_numel / 2), name


def _config(stage: int, threshold: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": threshold,
            "offload_optimizer": {"device": "cpu"},
        },
    }


def _batches(rank: int, n: int):
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (2, 8), generator=g)
        yield {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}


def _train(engine, steps: int, rank: int) -> None:
    for batch in _batches(rank, steps):
        engine.backward(engine(**batch))
        engine.step()


def _max_rel(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in b)


def _ranks():
    import torch.distributed as dist

    import meshtrain
    from meshtrain.zero import GatheredParameters, Init

    meshtrain.init_distributed()
    rank = dist.get_rank()
    out = {}

    # construction: shards only, and the same values as a normal build
    torch.manual_seed(0)
    with Init(config=_config(3, 0)):
        model = Net(check=True)
    _assert_sharded(model)
    local = sum(p.numel() + p.ds_tensor.numel() for p in model.parameters())
    shards = sum(math.ceil(p.ds_numel / 2) for p in model.parameters())
    total = sum(p.ds_numel for p in model.parameters())
    assert local == shards < total, (local, shards, total)
    torch.manual_seed(0)
    ref = Net()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        with GatheredParameters(p):
            assert p.shape == q.shape and torch.equal(p, q.data), name
        assert p.numel() == 0
        c = math.ceil(q.numel() / 2)
        mine = torch.cat([q.data.flatten(), q.new_zeros(2 * c - q.numel())])[rank * c :][:c]
        assert torch.equal(p.ds_tensor, mine), name

    # a change on rank 0 only lands in rank 1's shard (row 49 is in rank 1's half)
    with GatheredParameters(model.embed.weight, modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                model.embed.weight[VOCAB - 1].fill_(0.5)
    assert model.embed.weight.numel() == 0
    if rank == 1:
        assert torch.all(model.embed.weight.ds_tensor[-DIM:] == 0.5)
    with torch.no_grad():
        ref.embed.weight[VOCAB - 1].fill_(0.5)

    # training: Init-built vs normally built, ZeRO-3, a frozen parameter
    for threshold in (0, 60):
        torch.manual_seed(0)
        with Init(config=_config(3, threshold)):
            a = Net()
        torch.manual_seed(0)
        b = Net()
        for m in (a, b):
            m.blocks[0].norm.bias.requires_grad_(False)
        with GatheredParameters(a.embed.weight, modifier_rank=0):
            with torch.no_grad():
                a.embed.weight[VOCAB - 1].fill_(0.5)
        with torch.no_grad():
            b.embed.weight[VOCAB - 1].fill_(0.5)
        ea, *_ = meshtrain.initialize(model=a, config=_config(3, threshold))
        eb, *_ = meshtrain.initialize(model=b, config=_config(3, threshold))
        assert all(p.numel() == 0 for p in a.blocks[1].parameters()) or threshold
        _train(ea, 4, rank)
        _train(eb, 4, rank)
        out[f"t{threshold}_after_train"] = _max_rel(ea.module_state_dict(), eb.module_state_dict())

        # an engine-owned change on rank 0: in every shard and in the (separate) masters
        for e in (ea, eb):
            w = e.module.head.weight
            with GatheredParameters(w, modifier_rank=0):
                if rank == 0:
                    with torch.no_grad():
                        w[3].fill_(-0.25)
            with e.gathered_parameters():
                assert torch.all(e.module.head.weight[3] == -0.25), rank
        _train(ea, 2, rank)
        _train(eb, 2, rank)
        with ea.gathered_parameters():  # 2 AdamW steps of lr 1e-2 move it by <= ~0.02
            moved = (ea.module.head.weight[3] + 0.25).abs().max()
            assert moved < 0.05, f"the masters did not keep the change ({moved})"
        out[f"t{threshold}_after_modify"] = _max_rel(ea.module_state_dict(), eb.module_state_dict())

    # the reference decoder initialises its children after building them (like a
    # Hugging Face post_init); under Init it gathers each one: same values as outside
    from meshtrain.models import Decoder, DecoderConfig

    cfg = DecoderConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, ffn_dim=32)
    with Init(config=_config(3, 0)):
        dec = Decoder(cfg)
    plain = Decoder(cfg)
    for (name, p), q in zip(dec.named_parameters(), plain.parameters(), strict=True):
        assert p.numel() == 0, name
        with GatheredParameters(p):
            assert torch.equal(p, q.data), name

    # transformers models write their children's weights in post_init (GPT-2's
    # embeddings: N(0, 0.02), not nn.Embedding's N(0, 1)), and from_pretrained loads into
    # a model it built: both are partitioned once whole, with the values of a plain build
    import os
    import shutil
    import tempfile

    import transformers

    from tests.tiny_models import tiny_gpt2_config, tiny_llama

    torch.manual_seed(3)
    with Init(config=_config(3, 0)):
        built = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    torch.manual_seed(3)
    plain_hf = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    saved = tiny_llama(seed=4)
    # transformers writes on rank 0 only; the ranks share their parent's pid
    folder = os.path.join(tempfile.gettempdir(), f"zero-init-{os.getppid()}")
    if rank == 0:
        saved.save_pretrained(folder)
    dist.barrier()
    with Init(config=_config(3, 0)):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder)
    for model, ref in ((built, plain_hf), (loaded, saved)):
        pairs = zip(model.named_parameters(), ref.parameters(), strict=True)
        for (name, p), q in pairs:
            assert p.numel() == 0, name
            with GatheredParameters(p):
                assert torch.equal(p, q.data), name

    # a stage-2 engine from an Init-built model (partitioned parameters made whole)
    torch.manual_seed(0)
    with Init(config=_config(3, 0)):
        c = Net()
    torch.manual_seed(0)
    d = Net()
    ec, *_ = meshtrain.initialize(model=c, config=_config(2, 0))
    ed, *_ = meshtrain.initialize(model=d, config=_config(2, 0))
    _train(ec, 3, rank)
    _train(ed, 3, rank)
    out["stage2"] = _max_rel(ec.module_state_dict(), ed.module_state_dict())
    return out


def test_zero_init_shards_at_construction_and_trains_like_a_normal_build():
    for rank_out in run_ranks(_ranks, 2):
        for key, err in rank_out.items():
            assert err == 0.0, f"{key}: parameters differ by {err:.2e}"

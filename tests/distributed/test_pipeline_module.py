"""DeepSpeed's PipelineModule form and the automatic split's balancing.

Multi-rank: a sequential model with a tied input embedding / output head
(``TiedLayerSpec``) at pp 4, 1F1B and interleaved (2 stages per rank), against the same
PipelineModule built whole in one process: 10 SGD steps, losses within ``trajectory`` of
SGD's per-element steps (``tests/tolerance.py``). At step 1 every parameter's gradient on
every rank equals the reference exactly, except the tied embedding's, within
``gradient()`` normwise (measured 5e-8: its two halves are summed after the step instead
of per micro-batch). That difference on one weight then compounds through the updates
(measured up to 1.3e-6 on small biases by step 9), so later steps' gradients are held to
``gradient_from`` the parameter bound, normwise. Each rank builds only its own layers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshtrain.errors import ConfigError
from meshtrain.parallel.pipeline.split import Layout, partition, split_model
from meshtrain.pipe import LayerSpec, PipelineModule
from tests.harness import run_ranks
from tests.tiny_models import lm_loss, tiny_pipe_layers
from tests.tolerance import check, gradient, gradient_from, sgd_rate, trajectory

V, D, STEPS, MICRO = 32, 16, 10, 4


def specs():
    return tiny_pipe_layers(blocks=8, vocab=V, dim=D)[0]


def batches(step: int, m: int = MICRO):
    g = torch.Generator().manual_seed(500 + step)
    return [
        (torch.randint(0, V, (2, 4 + i), generator=g), torch.randint(0, V, (2, 4 + i), generator=g))
        for i in range(m)
    ]


def reference():
    """One process in a group of its own: it runs with each rank's intra-op threads (the
    same matmul blocking, so step 0's gradients can be compared bit for bit), and this
    process never runs a multi-threaded OpenMP region before it forks the ranks."""
    return run_ranks(_reference, 1)[0]


def _reference():
    pm = PipelineModule(specs(), loss_fn=lm_loss)
    opt = torch.optim.SGD(pm.parameters(), lr=0.02, momentum=0.9)
    losses, grads = [], []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for x, y in batches(step):
            loss = lm_loss(pm(x), y)
            (loss / MICRO).backward()
            total += loss.item()
        losses.append(total / MICRO)
        grads.append({n: p.grad.clone() for n, p in pm.named_parameters()})
        opt.step()
    return losses, grads


def _ranks():
    from meshtrain.distributed.topology import Topology
    from meshtrain.parallel.pipeline.runtime import PipelineRuntime

    topo = Topology(pp=torch.distributed.get_world_size())
    out = {}
    for name, v in (("1f1b", 1), ("interleaved_1f1b", 2)):
        pm = PipelineModule(specs(), topology=topo, loss_fn=lm_loss, virtual_stages=v)
        rt = PipelineRuntime(pm.stages, topo.pp_group, pm.num_stages, name, pm.tied)
        opt = torch.optim.SGD(pm.parameters(), lr=0.02, momentum=0.9)
        losses, grads = [], []
        for step in range(STEPS):
            opt.zero_grad()
            losses.append(rt.train_step(batches(step)).item())
            grads.append({n: p.grad.clone() for n, p in pm.named_parameters()})
            opt.step()
        built = sorted(int(k) for k in pm.layers)
        out[name] = (losses, grads, built, pm.bounds, sorted(pm.tied_modules))
    return out


def test_pipeline_module_matches_one_process():
    ref_losses, ref_grads = reference()
    per_rank = run_ranks(_ranks, 4)
    for name, v in (("1f1b", 1), ("interleaved_1f1b", 2)):
        names = set()
        for rank, got in enumerate(per_rank):
            losses, grads, built, bounds, tied = got[name]
            numel = sum(t.numel() for t in ref_grads[0].values())
            tol = trajectory(sgd_rate(0.02, numel, momentum=0.9), len(ref_losses))
            for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
                check(f"{name} rank {rank} loss {step}", abs(a - b) / abs(b), tol)
            for step, g in enumerate(grads):
                for n, t in g.items():
                    err = float((t - ref_grads[step][n]).norm() / ref_grads[step][n].norm())
                    if step > 0:
                        check(f"{name} rank {rank} step {step} {n}", err, gradient_from(tol))
                    elif n.startswith("tied_modules."):
                        check(f"{name} rank {rank} {n}", err, gradient())
                    else:
                        assert torch.equal(t, ref_grads[0][n]), (name, rank, n)
            names |= set(grads[0])
            # only this rank's layers were built; the tied embedding on first and last rank
            mine = [k for k in range(4 * v) if k % 4 == rank]
            assert built == [i for k in mine for i in range(bounds[k], bounds[k + 1]) if 0 < i < 10]
            assert tied == (["embed"] if rank in (0, 3) else [])
        assert names == set(dict(PipelineModule(specs(), loss_fn=lm_loss).named_parameters()))


def test_partition_methods():
    assert partition([1] * 8, 4) == [0, 2, 4, 6, 8]
    assert partition([1, 1, 1, 1, 4], 2) == [0, 4, 5]
    assert partition([1] * 4, 2, extra_first=2) == [0, 1, 4]
    with pytest.raises(ConfigError, match="cannot cut 3 layers into 4"):
        partition([1] * 3, 4)
    pm = PipelineModule(specs(), loss_fn=lm_loss, partition_method="type:block")
    assert pm.bounds == [0, 11]
    with pytest.raises(ConfigError, match="partition_method"):
        PipelineModule(specs(), partition_method="random")
    with pytest.raises(ConfigError, match="nn.Module class"):
        LayerSpec(len)


def test_split_balancing_and_errors():
    from meshtrain.models import Decoder, DecoderConfig

    model = Decoder(DecoderConfig(vocab_size=512, dim=32, n_layers=6, n_heads=2, ffn_dim=48))
    # embedding 16384 and head + norm 16416 parameters vs 8768 per block: the largest
    # stage is 33920 with cuts (2, 5) against 35072 with (1, 5), 43520 uniform
    by_params = [s.block_ids for s in split_model(model, 3)]
    assert by_params == [(0, 1), (2, 3, 4), (5,)]
    assert [s.block_ids for s in split_model(model, 3, method="uniform")] == [
        (0, 1),
        (2, 3),
        (4, 5),
    ]
    assert [s.block_ids for s in split_model(model, 2, cut_points=[4])] == [(0, 1, 2, 3), (4, 5)]
    with pytest.raises(ConfigError, match="cut_points"):
        split_model(model, 3, cut_points=[4, 2])
    with pytest.raises(ConfigError, match="cannot split"):
        split_model(nn.Sequential(nn.Linear(2, 2)), 2)
    with pytest.raises(ConfigError, match="partition_method"):
        split_model(model, 2, method="type:Block")
    with pytest.raises(ConfigError, match="not an nn.ModuleList"):
        split_model(nn.Sequential(nn.Linear(2, 2)), 1, layout=Layout("0", {}, ()))


@pytest.mark.parametrize(
    "family", ["bert-mlm", "bert-cls", "llama", "gpt2", "llama-cls", "gpt2-cls"]
)
def test_split_stages_chain_to_the_whole_model(family):
    """One process: the stages of an automatic split, called in a chain, give the whole
    model's loss and gradients exactly (the same modules run the same ops in the same
    order). The
    sequence classifiers' rows are right-padded by different amounts: their heads pool
    each row's last non-padding token, found in the real ids on the last stage."""
    import transformers as tf

    from tests.tiny_models import tiny_bert_config, tiny_gpt2_config, tiny_llama_config

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (3, 7))
    if family.startswith("bert"):
        cfg = tiny_bert_config(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=2,
            intermediate_size=48,
            max_position_embeddings=16,
            attn_implementation=None,
        )
        if family == "bert-mlm":
            model, labels = tf.BertForMaskedLM(cfg), ids
        else:
            model, labels = tf.BertForSequenceClassification(cfg), torch.tensor([0, 2, 1])
    elif family.startswith("llama"):
        cfg = tiny_llama_config(
            intermediate_size=48,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=16,
            num_labels=3,
            pad_token_id=0,
        )
        if family == "llama":
            model, labels = tf.LlamaForCausalLM(cfg), ids
        else:
            model, labels = tf.LlamaForSequenceClassification(cfg), torch.tensor([0, 2, 1])
    else:
        cfg = tiny_gpt2_config(
            vocab_size=64,
            n_embd=32,
            n_layer=4,
            n_head=2,
            n_positions=16,
            attn_implementation=None,
            num_labels=3,
            pad_token_id=0,
        )
        if family == "gpt2":
            model, labels = tf.GPT2LMHeadModel(cfg), ids
        else:
            model, labels = tf.GPT2ForSequenceClassification(cfg), torch.tensor([0, 2, 1])
    if family.endswith("-cls") and not family.startswith("bert"):
        ids = ids.clamp_min(1)
        ids[1, 5:], ids[2, 3:] = 0, 0  # right padding (pad id 0) of 2 and 4 tokens
    batch = {"input_ids": ids, "labels": labels, "attention_mask": (ids != 0).long()}
    whole = model(**batch).loss
    whole.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    x = None
    stages = split_model(model, 3, method="uniform")
    for stage in stages:
        x = stage(x, batch)  # in one process the graph runs through all stages
    assert torch.equal(x, whole)
    x.backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[n]), n
    assert sum(len(s.block_ids) for s in stages) == 4

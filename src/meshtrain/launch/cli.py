"""``meshtrain launch [options] SCRIPT [script args]``: torchrun's and DeepSpeed's flags.

Everything before SCRIPT belongs to the launcher, everything after it goes to the script
untouched (a ``--`` before SCRIPT is allowed). Three ways a job is laid out:

* one node: this process becomes the elastic agent (:mod:`meshtrain.launch.launcher`);
* ``--hostfile``: one agent per listed node, started over ssh (or directly when the node
  is this machine), see :mod:`meshtrain.launch.hostfile`; a hostfile naming only this
  machine is a one-node run with no ssh at all;
* inside a SLURM step with no node flags: nodes, node rank and master come from SLURM.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from meshtrain.errors import ConfigError
from meshtrain.launch import hostfile as hf
from meshtrain.launch.launcher import (
    LaunchSpec,
    gpu_count,
    resolve,
    run_agent,
    torchrun_command,
    validate_nnodes,
    validate_nproc,
)

_EPILOG = """examples:
  meshtrain launch --nproc_per_node 4 train.py --lr 1e-4
  meshtrain launch --num_gpus 8 -m mypkg.train
  meshtrain launch --nnodes 2 --node_rank 0 --master_addr 10.0.0.1 --master_port 29500 train.py
  meshtrain launch --nnodes 1:4 --rdzv_backend c10d --rdzv_endpoint 10.0.0.1:29400 train.py
  meshtrain launch --hostfile hosts.txt --include "node1@node2:0,1" train.py
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``meshtrain launch`` on the top-level ``meshtrain`` command."""
    p = subparsers.add_parser(
        "launch",
        help="run a training script on N processes / nodes (torchrun underneath)",
        description="Run SCRIPT on every process of the job, torchrun's elastic agent "
        "underneath. Accepts torchrun's and DeepSpeed's flags (either spelling).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # the script's own flags must never be taken for abbreviations of ours
        # (``-m meshtrain train --nproc 3`` is not ``--nproc_per_node``)
        allow_abbrev=False,
    )
    a = p.add_argument
    a(
        "--nproc_per_node",
        "--nproc-per-node",
        "--num_gpus",
        "--num-gpus",
        dest="nproc_per_node",
        metavar="N",
        help="processes per node: an integer or auto/gpu/cpu (default: the number of GPUs, else 1)",
    )
    a("--nnodes", default="1", metavar="N|MIN:MAX", help="number of nodes (default 1)")
    a(
        "--num_nodes",
        "--num-nodes",
        type=int,
        metavar="N",
        help="DeepSpeed spelling: with --hostfile use its first N hosts, else --nnodes N",
    )
    a("--node_rank", "--node-rank", type=int, default=0, help="this node's rank (default 0)")
    a("--master_addr", "--master-addr", help="address of node 0 (static rendezvous)")
    a(
        "--master_port",
        "--master-port",
        type=int,
        help="port on node 0 (default 29500 for several nodes; a free port for one)",
    )
    a(
        "--rdzv_backend",
        "--rdzv-backend",
        help="rendezvous backend: static or c10d (c10d when --rdzv_endpoint is given)",
    )
    a("--rdzv_endpoint", "--rdzv-endpoint", metavar="HOST:PORT", help="rendezvous address")
    a("--rdzv_id", "--rdzv-id", help="job id shared by all nodes of a c10d rendezvous")
    a("--rdzv_conf", "--rdzv-conf", help="extra rendezvous settings key=value,...")
    a(
        "--local_addr", "--local-addr",
        help="this node's address, where its host name does not resolve to it (torchrun's "
        "flag): what the other nodes reach a c10d rendezvous hosted here at",
    )  # fmt: skip
    a("--standalone", action="store_true", help="single node, rendezvous on a free port")
    a(
        "--max_restarts",
        "--max-restarts",
        type=int,
        default=0,
        help="restarts of the worker group after a failure (default 0)",
    )
    a(
        "--monitor_interval", "--monitor-interval", type=float,
        help="seconds between checks of the workers (default 1; torchrun's is 0.1)",
    )  # fmt: skip
    a("--start_method", "--start-method", choices=("spawn", "fork", "forkserver"))
    a("-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m")
    a("--no_python", "--no-python", action="store_true", help="SCRIPT is an executable")
    a("--log_dir", "--log-dir", help="folder for per-worker logs")
    a("-r", "--redirects", help="redirect worker std streams to --log_dir (torchrun syntax)")
    a("-t", "--tee", help="tee worker std streams to --log_dir (torchrun syntax)")
    a("-H", "--hostfile", help="DeepSpeed hostfile: lines 'hostname slots=N'")
    a("-i", "--include", help="hosts/slots to use, e.g. 'node1@node2:0,2'")
    a("-e", "--exclude", help="hosts/slots to leave out, e.g. 'node3:1'")
    a("--ssh_port", "--ssh-port", type=int, help="ssh port of the hostfile's nodes")
    a(
        "--dry_run",
        "--dry-run",
        action="store_true",
        help="print what would run (the torchrun or per-node commands) and exit",
    )
    a(
        "command",
        nargs=argparse.REMAINDER,
        metavar="SCRIPT [ARGS]",
        help="the training script (or module with -m) and its arguments",
    )
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace, runner: hf.Runner = hf.popen_runner) -> int:
    """Run ``meshtrain launch``; return the job's exit code (2 for a usage error).

    ``runner`` starts each node's command of a multi-node hostfile run (tests pass one
    that records the command lines instead of running ssh).
    """
    try:
        return _launch(args, runner)
    except ConfigError as exc:
        print(f"meshtrain launch: error: {exc}", file=sys.stderr)
        return 2


def spec_from_args(args: argparse.Namespace) -> LaunchSpec:
    """The :class:`LaunchSpec` the command line asks for (defaults not yet resolved)."""
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise ConfigError("missing SCRIPT: meshtrain launch [options] SCRIPT [script args]")
    nnodes = validate_nnodes(args.nnodes)
    if args.num_nodes and not args.hostfile:
        nnodes = validate_nnodes(str(args.num_nodes))
    return LaunchSpec(
        script=command[0],
        script_args=command[1:],
        nproc_per_node=validate_nproc(args.nproc_per_node) if args.nproc_per_node else None,
        nnodes=nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        rdzv_backend=args.rdzv_backend,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        rdzv_conf=args.rdzv_conf,
        local_addr=args.local_addr,
        standalone=args.standalone,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        start_method=args.start_method,
        module=args.module,
        no_python=args.no_python,
        log_dir=args.log_dir,
        redirects=args.redirects,
        tee=args.tee,
    )


def _launch(args: argparse.Namespace, runner: hf.Runner) -> int:
    spec = spec_from_args(args)
    if args.hostfile or args.include or args.exclude:
        resources = _resources(args, spec)
        if len(resources) > 1 or not hf.is_local(next(iter(resources))):
            commands = hf.node_commands(
                resources,
                spec,
                master_addr=args.master_addr,
                master_port=args.master_port,
                ssh_port=args.ssh_port,
            )
            if args.dry_run:
                for c in commands:
                    print(f"# node {c.node_rank} ({c.host})")
                    print(shlex.join([*(f"{k}={v}" for k, v in c.env.items()), *c.argv]))
                return 0
            return hf.run_nodes(commands, runner)
        # only this machine: an ordinary one-node run, no ssh
        slots = next(iter(resources.values()))
        spec = spec.replace(nproc_per_node=str(len(slots)))
        if slots != list(range(len(slots))):
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
    spec, notices = resolve(spec)
    for notice in notices:
        print(notice, file=sys.stderr)
    if args.dry_run:
        print(torchrun_command(spec))
        return 0
    return run_agent(spec)


def _resources(args: argparse.Namespace, spec: LaunchSpec) -> dict[str, list[int]]:
    """Hosts and slots after the hostfile, --include/--exclude, --num_nodes, --num_gpus."""
    if args.hostfile:
        if spec.nnodes != "1" or spec.node_rank:
            raise ConfigError(
                "--hostfile decides the nodes and their ranks; drop --nnodes/--node_rank "
                "(use --num_nodes N to run on the first N hosts)"
            )
        hosts = hf.parse_hostfile(args.hostfile)
    else:  # DeepSpeed allows --include localhost:0,1 with no hostfile: this machine's GPUs
        n = spec.nproc_per_node
        hosts = {"localhost": int(n) if n and n.isdigit() else max(gpu_count(), 1)}
    resources = hf.filter_hosts(hosts, args.include, args.exclude)
    if args.num_nodes:
        if args.num_nodes > len(resources):
            raise ConfigError(
                f"--num_nodes {args.num_nodes} but only {len(resources)} host(s) are available "
                f"({', '.join(resources)})"
            )
        resources = dict(list(resources.items())[: args.num_nodes])
    n = spec.nproc_per_node
    if args.hostfile and n and n.isdigit():  # DeepSpeed: --num_gpus caps the slots per host
        short = [h for h, s in resources.items() if len(s) < int(n)]
        if short:
            raise ConfigError(
                f"--nproc_per_node {n} but {short[0]} has only {len(resources[short[0]])} slots"
            )
        resources = {h: s[: int(n)] for h, s in resources.items()}
    return resources

"""Flag translation, defaults and SLURM detection of ``meshtrain launch`` (no processes)."""

from __future__ import annotations

import os

import pytest

from meshtrain.cli import build_parser
from meshtrain.errors import ConfigError
from meshtrain.launch import cli as launch_cli
from meshtrain.launch.failure import exit_code
from meshtrain.launch.launcher import (
    LaunchSpec,
    default_nproc_per_node,
    resolve,
    slurm_node,
    spec_flags,
    torchrun_command,
)

SLURM = {
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_JOB_ID": "123456",
}


def _spec(*argv: str) -> LaunchSpec:
    return launch_cli.spec_from_args(build_parser().parse_args(["launch", *argv]))


@pytest.mark.parametrize("flag", ["--nproc_per_node", "--nproc-per-node", "--num_gpus"])
def test_every_spelling_of_processes_per_node(flag):
    assert _spec(flag, "4", "t.py").nproc_per_node == "4"


def test_script_and_its_args_are_split_at_the_script():
    spec = _spec("--nnodes", "2", "--", "train.py", "--nnodes", "5", "--", "-m")
    assert (spec.script, spec.script_args, spec.nnodes) == (
        "train.py", ["--nnodes", "5", "--", "-m"], "2"
    )  # fmt: skip
    assert _spec("-m", "pkg.train", "--lr", "1").module


def test_flags_reach_torchrun_unchanged():
    """What we hand torchrun parses to what the user asked for."""
    from torch.distributed.run import get_args_parser

    spec = _spec(
        *"--nproc_per_node 3 --nnodes 1:4 --rdzv_endpoint h:29400 --rdzv_id job7"
        " --max_restarts 2 -m pkg.train --x".split()
    )
    spec, _ = resolve(spec, environ={}, gpus=0)
    args = get_args_parser().parse_args([*spec_flags(spec), "--", spec.script])
    assert (args.nproc_per_node, args.nnodes, args.rdzv_backend, args.rdzv_endpoint) == (
        "3", "1:4", "c10d", "h:29400"
    )  # fmt: skip
    assert (args.rdzv_id, args.max_restarts, args.module, args.training_script) == (
        "job7", 2, True, "pkg.train"
    )  # fmt: skip
    assert torchrun_command(spec).endswith("--module pkg.train --x")


def test_default_processes_per_node_is_gpus_else_one_with_a_notice():
    assert default_nproc_per_node(gpus=8) == ("8", None)
    nproc, notice = default_nproc_per_node(gpus=0)
    assert nproc == "1" and "1 CPU process per node" in notice and "--nproc_per_node" in notice
    spec, notices = resolve(LaunchSpec("t.py"), environ={}, gpus=0)
    assert spec.nproc_per_node == "1" and notices == [notice]
    assert resolve(LaunchSpec("t.py", nproc_per_node="2"), environ={}, gpus=0)[1] == []


def test_slurm_allocation_gives_nodes_rank_and_master():
    assert slurm_node(SLURM) == {
        "nnodes": "2", "node_rank": 1, "master_addr": "gpu07", "master_port": 29500 + 456,
    }  # fmt: skip
    assert slurm_node({**SLURM, "MASTER_PORT": "1234"})["master_port"] == 1234
    assert slurm_node({"SLURM_JOB_NODELIST": "gpu1"}) is None  # not enough to go on
    spec, notices = resolve(LaunchSpec("t.py", nproc_per_node="4"), environ=SLURM)
    assert (spec.nnodes, spec.node_rank, spec.master_addr) == ("2", 1, "gpu07")
    assert notices == ["meshtrain launch: SLURM allocation, node 1 of 2, master gpu07:29956"]


def test_explicit_flags_beat_slurm_and_one_node_allocations_stay_local():
    spec = LaunchSpec("t.py", nproc_per_node="1", nnodes="2", master_addr="10.0.0.1")
    assert resolve(spec, environ=SLURM)[0] == spec
    one = {**SLURM, "SLURM_JOB_NODELIST": "gpu07", "SLURM_NNODES": "1", "SLURM_NODEID": "0"}
    spec, _ = resolve(LaunchSpec("t.py", nproc_per_node="1"), environ=one)
    assert (spec.nnodes, spec.master_addr) == ("1", None)  # free-port c10d on one node


def test_slurm_nodelist_that_disagrees_is_an_error():
    with pytest.raises(ConfigError, match="SLURM_NNODES=3"):
        slurm_node({**SLURM, "SLURM_NNODES": "3"})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "missing SCRIPT"),
        (["--nproc_per_node", "0", "t.py"], "--nproc_per_node='0'"),
        (["--nnodes", "3:2", "t.py"], "--nnodes='3:2'"),
        (["--nnodes", "2", "t.py"], "needs a meeting point"),
        (["--nnodes", "1:2", "--master_addr", "h", "t.py"], "elastic range"),
    ],
)
def test_usage_errors_exit_2_with_the_reason(capsys, argv, message):
    assert launch_cli.main(build_parser().parse_args(["launch", *argv])) == 2
    assert message in capsys.readouterr().err


def test_dry_run_prints_the_torchrun_command(capsys, monkeypatch):
    for key in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(key, raising=False)
    argv = "launch --num_gpus 2 --nnodes 2 --node_rank 1 --master_addr 10.0.0.1"
    argv += " --master_port 29500 --dry_run train.py --epochs 3"
    args = build_parser().parse_args(argv.split())
    assert launch_cli.main(args) == 0
    assert capsys.readouterr().out.strip() == (
        "torchrun --nproc_per_node 2 --nnodes 2 --node_rank 1 --master_addr 10.0.0.1 "
        "--master_port 29500 --max_restarts 0 train.py --epochs 3"
    )


def test_include_without_hostfile_picks_local_gpus(capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # so it is restored after the test
    args = build_parser().parse_args(
        ["launch", "--num_gpus", "4", "--include", "localhost:1,3", "--dry_run", "t.py"]
    )
    assert launch_cli.main(args) == 0
    assert "--nproc_per_node 2 " in capsys.readouterr().out
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,3"  # the workers inherit it


def test_exit_codes_read_like_a_shell():
    assert [exit_code(c) for c in (0, 3, -9, -15, None)] == [0, 3, 137, 143, 1]


def test_agent_waits_only_for_workers_that_can_still_leave_on_their_own():
    """The patient agent's rule (meshtrain.launch.agent): after a worker exited, wait for
    running workers unless they published a stall or are stopped; never before an exit."""
    from meshtrain.launch.agent import leaving_on_their_own

    raised = {1: {"reason": "exception"}}
    # rank 1 raised and exited (zombie or reaped); rank 0 has not noticed yet, or is
    # explaining (its collective failed): wait for it either way
    assert leaving_on_their_own({0: "S", 1: "Z"}, raised) == [0]
    assert leaving_on_their_own({0: "R", 1: None}, {**raised, 0: {"reason": "error"}}) == [0]
    # the hang case: the survivor is stuck in Python (stalled) or stopped: stop it now
    assert leaving_on_their_own({0: None, 1: "S"}, {1: {"reason": "stalled"}}) == []
    assert leaving_on_their_own({0: None, 1: "T"}, {}) == []
    # nobody exited yet, or everybody did: torch's own monitoring decides
    assert leaving_on_their_own({0: "S", 1: "R"}, raised) == []
    assert leaving_on_their_own({0: "Z", 1: None}, raised) == []


def test_agent_exports_the_rendezvous_round_every_node_shares():
    """The round torch's c10d rendezvous completed is what numbers a start's store keys
    (``rank_records.attempt``): read from torch's real handler, one node, two rounds; the
    restart count is the fallback only."""
    import socket

    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from meshtrain.distributed.rank_records import ROUND_ENV, attempt
    from meshtrain.launch.agent import rendezvous_round

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    params = RendezvousParameters(
        backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="round-test",
        min_nodes=1, max_nodes=1, is_host=True,
    )  # fmt: skip
    handler = get_rendezvous_handler(params)
    try:
        handler.next_rendezvous()
        first = rendezvous_round(handler)
        handler.next_rendezvous()
        second = rendezvous_round(handler)
    finally:
        handler.shutdown()
    assert (first, second) == (0, 1)
    assert rendezvous_round(object()) is None  # a static rendezvous has no rounds
    # node 0 restarted its healthy workers for node 1's new round: its own count says 0
    assert attempt({ROUND_ENV: "1", "TORCHELASTIC_RESTART_COUNT": "0"}) == 1
    assert attempt({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert attempt({}) == 0

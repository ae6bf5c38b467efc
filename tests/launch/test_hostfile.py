"""Hostfile parsing, DeepSpeed's --include/--exclude, and the exact per-node commands.

No process is started here: the multi-node runner is replaced by one that records the
command lines, which is how the ssh fan-out is checked without ssh.
"""

from __future__ import annotations

import shlex
import signal
import sys
from pathlib import Path

import pytest

from meshtrain.cli import build_parser
from meshtrain.errors import ConfigError
from meshtrain.launch import cli as launch_cli
from meshtrain.launch.hostfile import (
    filter_hosts,
    node_commands,
    parse_filter,
    parse_hostfile,
    run_nodes,
)
from meshtrain.launch.launcher import LaunchSpec

HOSTS = {"worker-0": 4, "worker-1": 4, "worker-2": 2}


def _hostfile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return path


@pytest.fixture(autouse=True)
def _no_env_files(tmp_path_factory, monkeypatch):
    """The fan-out exports ``.deepspeed_env`` / ``.meshtrain_env`` from ``~`` and the cwd;
    the exact command lines below must not depend on such files of the machine running
    the tests: an empty home and working folder."""
    empty = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(empty))
    monkeypatch.chdir(empty)


def test_parse_hostfile_reads_slots_in_order_and_skips_comments(tmp_path):
    path = _hostfile(tmp_path, "# cluster\nworker-1 slots=4\n\nworker-0 slots=8  # big one\n")
    assert list(parse_hostfile(path).items()) == [("worker-1", 4), ("worker-0", 8)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("worker-1 slots=4\nworker-2 4\n", r"hostfile:2: 'worker-2 4' is not 'hostname slots=N'"),
        ("a slots=1\na slots=2\n", r"hostfile:2: host 'a' is listed twice"),
        ("a slots=0\n", r"hostfile:1: a has slots=0"),
        ("# nothing\n", "no 'hostname slots=N' lines"),
    ],
)
def test_bad_hostfile_names_file_and_line(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        parse_hostfile(_hostfile(tmp_path, text))


def test_missing_hostfile_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it"):
        parse_hostfile(tmp_path / "nope")


def test_include_and_exclude_follow_deepspeed_syntax():
    assert parse_filter("worker-0@worker-1:0,2") == {"worker-0": None, "worker-1": [0, 2]}
    assert filter_hosts(HOSTS, include="worker-1:0,2@worker-0") == {
        "worker-0": [0, 1, 2, 3],
        "worker-1": [0, 2],
    }  # hostfile order, not filter order
    assert filter_hosts(HOSTS, exclude="worker-0@worker-2:1") == {
        "worker-1": [0, 1, 2, 3],
        "worker-2": [0],
    }
    assert filter_hosts(HOSTS) == {h: list(range(n)) for h, n in HOSTS.items()}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"include": "worker-0", "exclude": "worker-1"}, "cannot be used together"),
        ({"include": "worker-9"}, "names 'worker-9', which is not in the hostfile"),
        ({"include": "worker-2:2"}, "worker-2 has slots 0..1; no slot 2"),
        ({"include": "worker-0:a"}, "slots of 'worker-0' must be integers"),
        ({"exclude": "worker-0@worker-1@worker-2"}, "leaves no host"),
    ],
)
def test_bad_filters_say_what_is_wrong(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        filter_hosts(HOSTS, **kwargs)


def test_node_commands_over_ssh_are_exact():
    spec = LaunchSpec(script="train.py", script_args=["--lr", "1e-4", "--x y"], max_restarts=2)
    resources = {"worker-0": [0, 1, 2, 3], "worker-1": [1, 3]}
    environ = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/src", "SECRET": "no", "HOME": "/root"}
    commands = node_commands(
        resources,
        spec,
        master_port=29600,
        ssh_port=2222,
        environ=environ,
        cwd="/data/my job",
        python="/venv/bin/python",
    )
    assert [(c.host, c.node_rank) for c in commands] == [("worker-0", 0), ("worker-1", 1)]
    ssh, host, remote = commands[1].argv[:-2], commands[1].argv[-2], commands[1].argv[-1]
    assert ssh == ["ssh", "-o", "BatchMode=yes", "-p", "2222"] and host == "worker-1"
    # the agent runs under its tether (stops it when the launcher's channel ends)
    launch = [
        *"/venv/bin/python -u -m meshtrain.launch.tether --"
        " /venv/bin/python -u -m meshtrain launch --nproc_per_node 2 --nnodes 2 --node_rank 1"
        " --master_addr worker-0 --master_port 29600 --max_restarts 2 -- train.py --lr 1e-4".split(),
        "--x y",
    ]
    assert remote == (
        "cd '/data/my job' && exec env NCCL_DEBUG=INFO PYTHONPATH=/src "
        "CUDA_VISIBLE_DEVICES=1,3 " + shlex.join(launch)
    )
    # node 0 uses all its slots: no CUDA_VISIBLE_DEVICES, and rank 0 is left implicit
    assert "CUDA_VISIBLE_DEVICES" not in commands[0].argv[-1]
    node0 = commands[0].argv[-1]
    assert "--node_rank" not in node0 and "--nproc_per_node 4" in node0


def test_local_first_host_is_named_for_remote_nodes(monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "head-node")
    commands = node_commands({"localhost": [0], "worker-1": [0]}, LaunchSpec("t.py"), environ={})
    assert commands[0].argv[0] == sys.executable  # this machine: no ssh
    assert commands[0].argv[commands[0].argv.index("--master_addr") + 1] == "head-node"
    assert commands[1].argv[0] == "ssh" and "--master_addr head-node" in commands[1].argv[-1]


class FakeProcess:
    """Finishes with ``code`` after ``polls`` polls, or never; records signals."""

    def __init__(self, code: int, polls: int = 0):
        self.code, self.polls, self.signals = code, polls, []

    def poll(self):
        if self.polls is None:
            return None if not self.signals else -signal.SIGTERM
        self.polls -= 1
        return self.code if self.polls < 0 else None

    def wait(self, timeout=None):
        return self.poll()

    def send_signal(self, sig):
        self.signals.append(sig)

    def kill(self):
        self.signals.append(signal.SIGKILL)


def test_cli_hostfile_fans_out_through_the_runner(tmp_path, capsys):
    path = _hostfile(tmp_path, "worker-0 slots=2\nworker-1 slots=2\nworker-2 slots=2\n")
    started, procs = [], [FakeProcess(0, polls=None), FakeProcess(3, polls=1), FakeProcess(0)]

    def runner(command):
        started.append(command)
        return procs[len(started) - 1]

    argv = f"launch --hostfile {path} --exclude worker-1:1 --master_port 29601 train.py --epochs 1"
    args = build_parser().parse_args(argv.split())
    assert launch_cli.main(args, runner=runner) == 3
    assert [c.host for c in started] == ["worker-0", "worker-1", "worker-2"]
    assert "--nproc_per_node 1 --nnodes 3 --node_rank 1" in started[1].argv[-1]
    assert "CUDA_VISIBLE_DEVICES" not in started[1].argv[-1]  # slot 0 only: same as default
    assert procs[0].signals == [signal.SIGTERM]  # still running when node 1 failed: stopped
    assert "node 1 (worker-1) exited with code 3" in capsys.readouterr().err


def test_run_nodes_reports_signals_as_shell_codes():
    assert run_nodes([_cmd(0), _cmd(1)], runner=_runner([FakeProcess(0), FakeProcess(-9)])) == 137
    assert run_nodes([_cmd(0)], runner=_runner([FakeProcess(0, polls=2)])) == 0


def _cmd(rank):
    from meshtrain.launch.hostfile import NodeCommand

    return NodeCommand(f"h{rank}", rank, ["true"])


def _runner(procs):
    it = iter(procs)
    return lambda command: next(it)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hostfile", "{hf}", "--nnodes", "2", "t.py"], "--hostfile decides the nodes"),
        (["--hostfile", "{hf}", "--num_nodes", "3", "t.py"], "--num_nodes 3 but only 2 host"),
        (["--hostfile", "{hf}", "--num_gpus", "3", "t.py"], "--nproc_per_node 3 but b has only 1"),
    ],
)
def test_hostfile_flag_conflicts_exit_2(tmp_path, capsys, argv, message):
    path = _hostfile(tmp_path, "a slots=4\nb slots=1\n")
    args = build_parser().parse_args(["launch", *(a.format(hf=path) for a in argv)])
    assert launch_cli.main(args, runner=lambda c: pytest.fail("must not start")) == 2
    assert message in capsys.readouterr().err


def test_num_nodes_and_num_gpus_trim_the_hostfile_like_deepspeed(tmp_path, capsys):
    path = _hostfile(tmp_path, "a slots=4\nb slots=4\nc slots=4\n")
    argv = f"launch --hostfile {path} --num_nodes 2 --num_gpus 2 --dry_run t.py"
    args = build_parser().parse_args(argv.split())
    assert launch_cli.main(args) == 0
    out = capsys.readouterr().out
    assert "# node 0 (a)" in out and "# node 1 (b)" in out and "(c)" not in out
    assert out.count("--nproc_per_node 2 --nnodes 2") == 2

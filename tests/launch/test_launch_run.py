"""``meshtrain launch`` for real: worker processes, gloo collectives, exit codes, two nodes.

Every test starts real launcher processes (each worker imports torch, ~1-2 s), so each
one checks several things per launch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.launch.hostfile import node_commands, run_nodes
from meshtrain.launch.launcher import LaunchSpec
from meshtrain.launch.processes import free_port
from tests.launch import HELLO, clean_env, run_launch


def _ranks(stdout: str) -> list[str]:
    return sorted(line for line in stdout.splitlines() if line.startswith("rank "))


@pytest.fixture
def no_ssh(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose ``ssh`` only leaves a mark: proves local nodes skip ssh."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mark = tmp_path / "ssh-was-called"
    ssh = bin_dir / "ssh"
    ssh.write_text(f'#!/bin/sh\necho "$@" > {mark}\nexit 99\n')
    ssh.chmod(0o755)
    return clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}"), mark


def test_two_processes_run_and_exit_code_passes_through():
    ok = run_launch("--nproc_per_node", "2", str(HELLO))
    assert ok.returncode == 0, ok.stderr
    lines = _ranks(ok.stdout)
    assert len(lines) == 2, ok.stdout
    assert lines[0].startswith("rank 0/2") and lines[1].startswith("rank 1/2")
    assert all("sum 3 expected 3" in line for line in lines)

    # the job's exit code, not torchrun's blanket 1; the DeepSpeed spelling of the flag
    failed = run_launch("--num_gpus", "2", str(HELLO), "--fail-rank", "1", "--exit-code", "7")
    assert failed.returncode == 7, failed.stderr
    assert "rank 1 (local rank 1) exited with code 7" in failed.stderr


def test_module_mode_script_args_verbatim_and_cpu_notice(tmp_path: Path):
    (tmp_path / "echo_args.py").write_text(
        "import os, sys\nprint('ARGS', sys.argv[1:], os.environ['WORLD_SIZE'])\n"
    )
    out = run_launch("-m", "--", "echo_args", "--nnodes", "3", "--", "x", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    # launcher-looking flags after the script are the script's, untouched
    assert "ARGS ['--nnodes', '3', '--', 'x'] 1" in out.stdout
    # clean_env hides GPUs, so the default is one CPU process, and the launcher says so
    assert "no GPU found, running 1 CPU process per node" in out.stderr
    assert "--nproc_per_node N" in out.stderr


def test_two_nodes_on_localhost_with_c10d_rendezvous():
    """Two launchers on this machine act as nodes 0 and 1 and form one world of 2."""
    port = free_port()
    common = "--nnodes 2 --nproc_per_node 1 --rdzv_backend c10d --rdzv_id two-nodes".split()
    common += ["--rdzv_endpoint", f"127.0.0.1:{port}"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "meshtrain", "launch", *common, "--node_rank", str(rank), HELLO],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
        for rank in (0, 1)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=120))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err
        (line,) = _ranks(out)
        # world of 2, sum over both nodes, and both node ranks seen by every worker
        assert "/2 " in line and "sum 3 expected 3" in line and "nodes 0,1" in line, line
    seen = sorted(_ranks(outputs[0][0]) + _ranks(outputs[1][0]))
    assert [s.split()[1] for s in seen] == ["0/2", "1/2"]


def test_localhost_only_hostfile_runs_locally_without_ssh(tmp_path: Path, no_ssh):
    env, mark = no_ssh
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# this machine only\nlocalhost slots=2\n")
    out = run_launch("--hostfile", str(hostfile), str(HELLO), env=env)
    assert out.returncode == 0, out.stderr
    lines = _ranks(out.stdout)
    assert len(lines) == 2 and all("nodes 0" in line for line in lines), out.stdout
    assert not mark.exists()


def test_hostfile_of_two_local_names_fans_out_as_two_nodes(tmp_path: Path, no_ssh):
    """Both names are this machine: two node agents as plain subprocesses, no ssh."""
    env, mark = no_ssh
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    port = str(free_port())
    out = run_launch("--hostfile", str(hostfile), "--master_port", port, str(HELLO), env=env)
    assert out.returncode == 0, out.stderr
    lines = _ranks(out.stdout)
    assert len(lines) == 2 and all("nodes 0,1" in line for line in lines), out.stdout

    assert not mark.exists()


def test_failing_node_is_the_job_exit_code_and_the_others_are_stopped(capfd):
    """Node 1 exits 5 after its work; node 0's agent then waits in torchrun's exit
    barrier (deaf to SIGTERM) and must be stopped; the short grace keeps the test fast."""
    spec = LaunchSpec(script=str(HELLO), script_args=["--fail-rank", "1", "--exit-code", "5"])
    nodes = {"localhost": [0], "127.0.0.1": [0]}
    commands = node_commands(nodes, spec, master_port=free_port(), environ={})
    assert [c.node_rank for c in commands] == [0, 1]
    assert all(c.argv[0] == sys.executable for c in commands)  # local nodes: no ssh
    for c in commands:
        c.env["CUDA_VISIBLE_DEVICES"] = ""  # gloo, as in the other launch tests
    assert run_nodes(commands, grace_s=2.0) == 5
    err = capfd.readouterr().err
    assert "node 1 (127.0.0.1) exited with code 5" in err

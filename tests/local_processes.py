"""Runs of `python -m mercury_jax.main` as N processes on this machine, a stand-in for N hosts: a loopback coordinator
(`JAX_COORDINATOR_ADDRESS`), `devices` fake CPU devices in each process, every process's output in its own log.

    procs = launch(["--config", "experiments/sao.py:tiny", "--workdir", "/tmp/run"], logs=Path("/tmp/logs"),
                   processes=2, devices=4)
    wait(procs)          # raises LaunchFailed with the logs' tails when a process exits non-zero
    reports = run_reporting_script(Path("worker.py"), processes=5)   # {process: its last JSON line}
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.child_processes import ChildProcesses

ROOT = Path(__file__).resolve().parents[1]
# a caller's own multi-process or TPU settings (the AOT benchmarks set TPU_WORKER_HOSTNAMES) stay out of the children
_INHERITED_OUT = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "TPU_WORKER_HOSTNAMES")


class LaunchFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], *, logs: Path, processes: int, devices: int, name: str,
           compilation_cache: Path | None = None) -> list[subprocess.Popen]:
    """Start `processes` processes of `mercury_jax.main ARGS`; process r logs to `logs/NAME-pR.log` (appended, so a
    resumed run's log follows the killed one's). Each is its own process group (`kill` ends it with its children)."""
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(processes):
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
        for key in _INHERITED_OUT:
            env.pop(key, None)
        if compilation_cache is not None:
            env.update(JAX_COMPILATION_CACHE_DIR=str(compilation_cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                       JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        if processes > 1:
            env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
                       JAX_PROCESS_ID=str(rank))
        log = open(logs / f"{name}-p{rank}.log", "ab")  # noqa: SIM115  (closed with the process: `wait`, `kill`)
        proc = subprocess.Popen([sys.executable, "-m", "mercury_jax.main", *args], env=env, cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        proc.log = log
        procs.append(proc)
    return procs


def tails(logs: Path, chars: int = 3000) -> str:
    return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-chars:] for p in sorted(logs.glob("*.log")))


def kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every process group still running; wait for all."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()
        p.log.close()


def wait(procs: list[subprocess.Popen], *, logs: Path, timeout_s: float, until=None, expect: int = 0) -> bool:
    """Wait for every process to exit with `expect` (returns True), or for `until()` (returns False, the processes
    still running). A process that exits otherwise, or no result within `timeout_s`, kills them all and raises
    `LaunchFailed` with the logs' tails."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if any(c not in (None, expect) for c in codes):
            kill(procs)
            raise LaunchFailed(f"a process exited with {codes} (expected {expect})\n{tails(logs)}")
        if until is not None and until():
            return False
        if all(c == expect for c in codes):
            for p in procs:
                p.log.close()
            return True
        time.sleep(0.1)
    kill(procs)
    raise LaunchFailed(f"no result within {timeout_s:.0f} s\n{tails(logs)}")


def run_reporting_script(script: Path, *, processes: int, devices: int, args: tuple[str, ...] = (),
                         timeout_s: float = 300) -> dict[int, dict]:
    """Run `python SCRIPT ARGS` as `processes` processes of one JAX run (loopback coordinator, `devices` CPU devices
    each, the repository on the path: the script's environment is set here, before it imports JAX) and return each
    process's last JSON line (an object with a "process" key) by process. A process that exits non-zero raises
    `LaunchFailed` with its stderr's tail."""
    port, reports = free_port(), {}
    with ChildProcesses() as children:  # every exit path kills the workers (tests/child_processes.py)
        for rank in range(processes):
            env = {**os.environ, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(processes),
                   "JAX_PROCESS_ID": str(rank), "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
                   "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
            children.start([sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
        for proc in children.procs:
            out, err = proc.communicate(timeout=timeout_s)
            if proc.returncode != 0:
                raise LaunchFailed(f"{script.name} exited with {proc.returncode}\n{err[-3000:]}")
            report = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
            reports[report["process"]] = report
    return reports

"""Local multi-rank jobs: the environment a job needs, the command line of each launcher, and a
runner that kills the whole process group on a timeout (a hang fails instead of blocking).

One module for everything that starts ranks on this machine — the tests (``tests/harness.py``),
the benchmarks and the examples' scripts — so they agree on launchers and environment. It
imports nothing else of the package.

Launchers: ``"mpirun"`` (Open MPI, Horovod's MPI controller), ``"horovodrun-mpi"`` /
``"horovodrun-gloo"`` (Horovod's launcher with either controller) and ``"torchrun"``
(``python -m torch.distributed.run``, for the DDP hook).
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LAUNCHERS = ("mpirun", "horovodrun-mpi", "horovodrun-gloo", "torchrun")
#: the variables mpirun must forward to its ranks (``-x``)
ENV_NAMES = ("PATH", "PYTHONPATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "TF_CPP_MIN_LOG_LEVEL",
             "HOROVOD_LOG_LEVEL", "PYTHONFAULTHANDLER")


class JobTimeout(RuntimeError):
    def __init__(self, cmd: Sequence[str], timeout: float, output: str):
        super().__init__(f"{' '.join(map(str, cmd[:6]))} ... did not finish within "
                         f"{timeout:.0f} s (hang?)")
        self.output = output


def python_exe() -> str:
    return sys.executable


def job_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """This environment plus what every rank needs: the venv's binaries first on PATH, the
    repository on PYTHONPATH, one thread per rank, unbuffered output, quiet TF and Horovod.

    Open MPI waits for a peer by spinning; each rank also runs Horovod's background thread
    beside its main thread, so with as many ranks as cores a spinning wait takes the core from
    the rank's own computation. ``mpi_yield_when_idle`` makes the wait yield instead (mpirun
    reads ``OMPI_MCA_*`` from its environment and passes them on to the ranks)."""
    env = dict(os.environ)
    env["PATH"] = str(BIN) + os.pathsep + env.get("PATH", "")
    pp = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + pp if pp else "")
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                "PYTHONFAULTHANDLER": env.get("PYTHONFAULTHANDLER", "1"),
                "HOROVOD_LOG_LEVEL": env.get("HOROVOD_LOG_LEVEL", "warning"),
                "OMPI_MCA_mpi_yield_when_idle": env.get("OMPI_MCA_mpi_yield_when_idle", "1")})
    env.update(extra or {})
    return env


def launcher_prefix(np_: int, launcher: str = "mpirun",
                    env_names: Sequence[str] = ENV_NAMES) -> List[str]:
    """The launcher's part of the command line for ``np_`` local ranks (the program follows)."""
    if launcher == "mpirun":
        mpirun = shutil.which("mpirun")
        if not mpirun:  # no Open MPI on PATH: Horovod's launcher with its MPI controller
            return launcher_prefix(np_, "horovodrun-mpi")
        cmd = [mpirun, "--allow-run-as-root", "-np", str(np_), "-bind-to", "none",
               "-map-by", "slot"]
        if np_ > (os.cpu_count() or 1):
            cmd.insert(2, "--oversubscribe")
        for n in env_names:
            cmd += ["-x", n]
        return cmd
    if launcher in ("horovodrun-mpi", "horovodrun-gloo"):
        hr = shutil.which("horovodrun") or str(BIN / "horovodrun")
        return [hr, "-np", str(np_), "-H", f"localhost:{np_}",
                "--gloo" if launcher.endswith("gloo") else "--mpi"]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={np_}", "--monitor_interval=0.5"]
    raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")


def run(cmd: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None,
        on_line: Optional[Callable[[str], None]] = None) -> Tuple[int, str]:
    """Run ``cmd`` in its own process group from the repository root; returns (exit code,
    output). ``on_line`` sees each output line as it comes. On timeout the whole group is
    killed and :class:`JobTimeout` carries the output so far."""
    t0, cpu0 = time.monotonic(), _children_cpu()
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=str(ROOT), env=env if env is not None else job_env(),
                            start_new_session=True)
    lines: List[str] = []

    def pump():
        for line in proc.stdout:
            lines.append(line)
            if on_line is not None:
                on_line(line)

    import threading
    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        alive = _dump_stacks(proc.pid)
        kill_job(proc.pid)
        proc.wait()
        t.join(5)
        raise JobTimeout(cmd, timeout, "".join(lines) + alive) from None
    t.join(10)
    _log_job(cmd, time.monotonic() - t0, _children_cpu() - cpu0)
    return proc.returncode, "".join(lines)


def job_processes(sid: int) -> List[Tuple[int, str, str]]:
    """(pid, state, command line) of the live processes of the job whose launcher, started with
    ``start_new_session`` (as :func:`run` does), has pid ``sid``: the members of its session
    (mpirun puts its ranks in process groups of their own, but they stay in its session) and
    every descendant of the launcher (torchrun starts its workers in sessions of their own)."""
    procs = {}
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        fields = _stat_fields(int(d)) if d.isdigit() else None
        if fields is None:
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                args = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            procs[int(d)] = (fields[0], int(fields[1]), int(fields[3]), args[:160])
        except (OSError, ValueError, IndexError):
            continue
    members = {pid for pid, (_, _, session, _) in procs.items() if session == sid}
    todo = list(members | ({sid} if sid in procs else set()))
    while todo:
        parent = todo.pop()
        for pid, (_, ppid, _, _) in procs.items():
            if ppid == parent and pid not in members:
                members.add(pid)
                todo.append(pid)
    return sorted((pid, procs[pid][0], procs[pid][3]) for pid in members)


def kill_job(sid: int) -> None:
    """SIGKILL every live process of the job :func:`job_processes` lists."""
    for pid, _, _ in job_processes(sid):
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except OSError:
        return False


def _stat_fields(pid: int) -> Optional[List[str]]:
    """The fields of ``/proc/<pid>/stat`` after ``pid (comm)``: state, ppid, pgrp, session, ...;
    None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def _running(pid: int) -> bool:
    """``pid`` exists and has not exited (a zombie waits for its paused parent)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def _dump_stacks(sid: int) -> str:
    """A hung job's account before it is killed: the launcher ``sid`` is paused (so that it
    cannot end the other processes first), then every other process of the job gets SIGABRT,
    one at a time, on which a Python process started with ``PYTHONFAULTHANDLER=1`` (as
    :func:`job_env` sets) prints the stack of each of its threads; the launcher then resumes to
    pass on what its ranks wrote. Returns the list of the job's processes that were alive."""
    members = job_processes(sid)
    paused = _signal(sid, signal.SIGSTOP)
    for pid, _, _ in members:
        if pid != sid and _signal(pid, signal.SIGABRT):
            end = time.monotonic() + 2
            while _running(pid) and time.monotonic() < end:
                time.sleep(0.05)
    if paused:
        _signal(sid, signal.SIGCONT)
    if len(members) > 1:
        time.sleep(1)  # time to pass the stacks through the launcher's output
    return "\n--- processes alive at the timeout (pid, state, command) ---\n" + "".join(
        f"{pid} {state} {args}\n" for pid, state, args in members)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _log_job(cmd: Sequence[str], wall: float, cpu: float) -> None:
    """With ``SBC_JOB_LOG=<file>``, append one JSON line per finished job (its command, wall
    and CPU seconds of the processes it waited for): where a test suite's time goes."""
    path = os.environ.get("SBC_JOB_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"cmd": [str(c) for c in cmd][-12:], "wall": round(wall, 2),
                                "cpu": round(cpu, 2)}) + "\n")

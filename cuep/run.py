"""``python -m cuep.run -n N script.py [args...]``: start N processes, one rank each, for :func:`cuep.init_distributed`.

Each process runs ``sys.executable script.py args...`` with the variables torchrun sets: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT`` (a free port; rank 0 serves
cuep's rendezvous there). The device is left to the script: ``init_distributed()`` takes ``LOCAL_RANK`` modulo
the visible GPUs, so N larger than the GPU count puts several ranks on one GPU (for tests).
``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1`` are set unless the
environment sets them already (NVLink multicast stays off).

Output: every line of every rank, stdout and stderr, prefixed with ``[rank i]``. Exit status: 0 when every rank
exits 0; otherwise the first non-zero status seen (a rank killed by signal S counts as 128 + S), after stopping
the other ranks at once. ``--timeout`` (default 600 s) bounds the whole run: then every rank is stopped and the
launcher exits with 124.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TIMEOUT_STATUS = 124
_GRACE_S = 3.0   # between SIGTERM and SIGKILL when stopping ranks
_POLL_S = 0.05


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_env(rank: int, n: int, port: int, base: dict | None = None) -> dict:
    """The environment of rank ``rank`` of ``n``: ``base`` (default ``os.environ``) plus the launcher variables."""
    env = dict(os.environ if base is None else base)
    for k, v in NO_MULTICAST.items():
        env.setdefault(k, v)
    env.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    return env


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _pump(rank: int, stream, out, lock: threading.Lock) -> None:
    """Copy one rank's output line by line, each line prefixed with ``[rank i]``."""
    prefix = f"[rank {rank}] "
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n")
        with lock:
            out.write(prefix + line + "\n")
            out.flush()
    stream.close()


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every running rank's process group, SIGKILL what is left after a grace period."""
    live = [p for p in procs if p.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in live:
            try:
                os.killpg(p.pid, sig)  # each rank leads its own session: this reaches its children too
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + _GRACE_S
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        live = [p for p in live if p.poll() is None]
        if not live:
            return


def launch(n: int, cmd: list[str], timeout_s: float = 600.0, out=None, err=None) -> int:
    """Run ``cmd`` as ``n`` ranks; return 0, the first non-zero exit status, or 124 after ``timeout_s``."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    port = free_port()
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    status = 0
    try:
        for rank in range(n):
            p = subprocess.Popen(cmd, env=rank_env(rank, n, port), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(p)
            t = threading.Thread(target=_pump, args=(rank, p.stdout, out, lock), daemon=True)
            t.start()
            pumps.append(t)
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None:
                status = _exit_status(codes[failed])
                still = [r for r, c in enumerate(codes) if c is None]
                with lock:
                    err.write(f"cuep.run: rank {failed} exited with status {status}"
                              + (f"; stopping rank(s) {', '.join(map(str, still))}\n" if still else "\n"))
                    err.flush()
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() >= deadline:
                still = [r for r, c in enumerate(codes) if c is None]
                with lock:
                    err.write(f"cuep.run: timed out after {timeout_s:g} s (--timeout); stopping rank(s) "
                              f"{', '.join(map(str, still))} that had not finished\n")
                    err.flush()
                status = TIMEOUT_STATUS
                break
            time.sleep(_POLL_S)
    except KeyboardInterrupt:
        with lock:
            err.write("cuep.run: interrupted; stopping every rank\n")
        status = 130
    finally:
        _stop(procs)
        for t in pumps:
            t.join(timeout=_GRACE_S)
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cuep.run", description="Start N processes of a script, one cuep rank each "
        "(cuep.init_distributed), with the variables torchrun sets; prefix their output with [rank i].")
    p.add_argument("-n", "--nproc", type=int, required=True, help="ranks (processes) to start, 1..8")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds before every rank is stopped and the launcher exits 124 (default 600)")
    p.add_argument("script", help="the Python script every rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    a = p.parse_args(argv)
    if not 1 <= a.nproc <= 8:
        p.error(f"-n {a.nproc}: a node-local cuep group has 1..8 ranks")
    if not a.timeout > 0:
        p.error(f"--timeout {a.timeout:g} must be positive")
    if not os.path.isfile(a.script):
        p.error(f"script {a.script!r} not found")
    signal.signal(signal.SIGTERM, _interrupt)  # stopping the launcher stops its ranks too
    return launch(a.nproc, [sys.executable, a.script, *a.args], a.timeout)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())

"""``python -m cuep.run -n N [--gpus-per-node G] script.py [args...]``: start N processes, one rank each, for
:func:`cuep.init_distributed`.

Each process runs ``sys.executable script.py args...`` with the variables torchrun sets: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT`` (a free port; rank 0 serves
cuep's rendezvous there). Without ``--gpus-per-node`` the N ranks are one node (N is 1..8): ``LOCAL_RANK`` is the
rank and ``LOCAL_WORLD_SIZE`` is N. With ``--gpus-per-node G`` (1..8, dividing N) they are N / G nodes of G
consecutive ranks on this one host, as if on N / G machines: ``LOCAL_RANK = rank % G``, ``LOCAL_WORLD_SIZE = G``,
and ``init_distributed()`` takes that layout. The device is left to the script: ``init_distributed()`` takes
``LOCAL_RANK`` modulo the visible GPUs, so more ranks per node than GPUs put several ranks on one GPU (for tests:
on a one-GPU machine, ``-n 4 --gpus-per-node 2`` runs two nodes of two ranks, all four on GPU 0).
``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1`` are set unless the
environment sets them already (NVLink multicast stays off).

Output: every line of every rank, stdout and stderr, prefixed with ``[rank i]``.

When a rank fails (a non-zero exit, or killed by a signal) the launcher says which and how (``rank 2 was killed
by SIGKILL``) and gives the others ``--grace-s`` seconds (default 15: more than a round's default ``timeout_s`` of
5 s plus the time to raise :class:`cuep.EPError`, clean up and exit) to finish on their own; the ones still
running then are stopped (SIGTERM, then SIGKILL). Every rank's end is reported, and every child is waited for (no
zombies). Exit status: 0 when every rank exits 0; otherwise the first failure's (a rank killed by signal S counts as
128 + S). ``--timeout`` (default 600 s) bounds the whole run: then every rank is stopped and the launcher exits
with 124.
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

from .group import MAX_RANKS  # ranks per node

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TIMEOUT_STATUS = 124
GRACE_S = 15.0   # default --grace-s: how long the other ranks may take to finish after one failed
_STOP_S = 3.0    # between SIGTERM and SIGKILL when stopping ranks
_POLL_S = 0.05


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_env(rank: int, n: int, port: int, base: dict | None = None, gpus_per_node: int | None = None) -> dict:
    """The environment of rank ``rank`` of ``n``: ``base`` (default ``os.environ``) plus the launcher variables.

    ``gpus_per_node`` G (dividing ``n``): nodes of G consecutive ranks, ``LOCAL_RANK = rank % G`` and
    ``LOCAL_WORLD_SIZE = G``; None: one node of ``n`` (``LOCAL_RANK = rank``).
    """
    g = n if gpus_per_node is None else int(gpus_per_node)
    if g < 1 or n % g:
        raise ValueError(f"gpus_per_node={gpus_per_node} must be at least 1 and divide n={n}")
    env = dict(os.environ if base is None else base)
    for k, v in NO_MULTICAST.items():
        env.setdefault(k, v)
    env.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank % g), LOCAL_WORLD_SIZE=str(g),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    return env


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def how_it_ended(returncode: int) -> str:
    """``exited with status 3`` or ``was killed by SIGKILL (status 137)``, from a ``Popen.returncode``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (status {_exit_status(returncode)})"
    return f"exited with status {returncode}"


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
    """SIGTERM every running rank's process group, SIGKILL what is left after a while; reap every child."""
    live = [p for p in procs if p.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in live:
            try:
                os.killpg(p.pid, sig)  # each rank leads its own session: this reaches its children too
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + _STOP_S
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        live = [p for p in live if p.poll() is None]
        if not live:
            break
    for p in procs:  # no zombies: every child is waited for (SIGKILL cannot be ignored)
        try:
            p.wait(timeout=_STOP_S)
        except subprocess.TimeoutExpired:
            pass


def launch(n: int, cmd: list[str], timeout_s: float = 600.0, out=None, err=None, grace_s: float = GRACE_S,
           procs: list | None = None, gpus_per_node: int | None = None) -> int:
    """Run ``cmd`` as ``n`` ranks; return 0, the first failure's exit status, or 124 after ``timeout_s``.

    After the first failure the other ranks get ``grace_s`` seconds to finish on their own before they are
    stopped. ``procs``, if given, receives the ``subprocess.Popen`` of every rank (all waited for on return).
    ``gpus_per_node``: nodes of that many consecutive ranks (see :func:`rank_env`); None: one node.
    """
    rank_env(0, n, 0, {}, gpus_per_node)  # a bad layout fails before any rank starts
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    port = free_port()
    lock = threading.Lock()
    procs = [] if procs is None else procs
    pumps: list[threading.Thread] = []
    status = 0

    def say(msg: str) -> None:
        with lock:
            err.write(f"cuep.run: {msg}\n")
            err.flush()

    try:
        for rank in range(n):
            p = subprocess.Popen(cmd, env=rank_env(rank, n, port, gpus_per_node=gpus_per_node),
                                 stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(p)
            t = threading.Thread(target=_pump, args=(rank, p.stdout, out, lock), daemon=True)
            t.start()
            pumps.append(t)
        deadline = time.monotonic() + timeout_s
        failed_at = None   # when the first rank failed: the others' grace period runs from then
        told = set()       # ranks whose end was reported
        while True:
            codes = [p.poll() for p in procs]
            for r, c in enumerate(codes):
                if c is None or r in told or (c == 0 and failed_at is None):
                    continue
                told.add(r)
                if c != 0 and failed_at is None:
                    failed_at, status = time.monotonic(), _exit_status(c)
                    still = [q for q, cq in enumerate(codes) if cq is None]
                    say(f"rank {r} {how_it_ended(c)}" + (
                        f"; waiting up to {grace_s:g} s (--grace-s) for rank{'s' if len(still) > 1 else ''} "
                        f"{', '.join(map(str, still))} to finish" if still else ""))
                else:
                    say(f"rank {r} {how_it_ended(c)}")
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if failed_at is not None and now >= failed_at + grace_s:
                still = [r for r, c in enumerate(codes) if c is None]
                say(f"rank{'s' if len(still) > 1 else ''} {', '.join(map(str, still))} still running {grace_s:g} s "
                    f"after the first failure (--grace-s); stopping them")
                break
            if now >= deadline:
                still = [r for r, c in enumerate(codes) if c is None]
                say(f"timed out after {timeout_s:g} s (--timeout); stopping rank(s) {', '.join(map(str, still))} "
                    f"that had not finished")
                status = TIMEOUT_STATUS
                break
            time.sleep(_POLL_S)
    except KeyboardInterrupt:
        say("interrupted; stopping every rank")
        status = 130
    finally:
        stopped = {r for r, p in enumerate(procs) if p.poll() is None}
        _stop(procs)
        for t in pumps:
            t.join(timeout=_STOP_S)
    if status:
        ends = [f"rank {r} " + (how_it_ended(p.returncode) if p.returncode is not None else "did not end")
                + (" (stopped by cuep.run)" if r in stopped else "") for r, p in enumerate(procs)]
        say("how every rank ended: " + "; ".join(ends))
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cuep.run", description="Start N processes of a script, one cuep rank each "
        "(cuep.init_distributed), with the variables torchrun sets; prefix their output with [rank i].")
    p.add_argument("-n", "--nproc", type=int, required=True,
                   help="ranks (processes) to start: 1..8 on one node, or a multiple of --gpus-per-node")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="G",
                   help="ranks per node, 1..8, dividing -n: -n / G nodes of G consecutive ranks on this host "
                        "(LOCAL_RANK = rank %% G, LOCAL_WORLD_SIZE = G); default one node of all -n ranks")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds before every rank is stopped and the launcher exits 124 (default 600)")
    p.add_argument("--grace-s", type=float, default=GRACE_S,
                   help=f"seconds the other ranks may take to finish on their own after one failed, before they are "
                        f"stopped (default {GRACE_S:g})")
    p.add_argument("script", help="the Python script every rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    a = p.parse_args(argv)
    g = a.gpus_per_node
    if a.nproc < 1 or (g is None and a.nproc > MAX_RANKS):
        p.error(f"-n {a.nproc}: a node-local cuep group has 1..{MAX_RANKS} ranks (more ranks need several nodes: "
                f"--gpus-per-node G)")
    if g is not None and not 1 <= g <= MAX_RANKS:
        p.error(f"--gpus-per-node {g}: a node holds 1..{MAX_RANKS} ranks (the NVLink domain cuep supports)")
    if g is not None and a.nproc % g:
        p.error(f"--gpus-per-node {g} must divide -n {a.nproc} (nodes of G consecutive ranks)")
    if not a.timeout > 0:
        p.error(f"--timeout {a.timeout:g} must be positive")
    if not a.grace_s >= 0:
        p.error(f"--grace-s {a.grace_s:g} must not be negative")
    if not os.path.isfile(a.script):
        p.error(f"script {a.script!r} not found")
    signal.signal(signal.SIGTERM, _interrupt)  # stopping the launcher stops its ranks too
    return launch(a.nproc, [sys.executable, a.script, *a.args], a.timeout, grace_s=a.grace_s, gpus_per_node=g)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())

"""One rank of a one-process-per-rank group that meets a fault in the middle of a round (tests/test_faults_gpu.py).

Run under the launcher with every rank on GPU 0 (the phase-by-phase mode with host barriers), e.g.::

    python -m cuep.run -n 3 --grace-s 60 tests/fault_worker.py --mode kill --victim 2

Modes (every rank first runs a warm-up round checked against cuep.reference, so kernels are compiled and the
first-launch barriers are behind):

* ``kill``: every rank starts a round (``dispatch_async``); the victim then SIGKILLs itself. Every other rank must
  get a ``cuep.EPError`` naming the victim (reason ``"died"``) at its next call, find the buffer refusing rounds,
  close the buffer and the group (every IPC mapping closed) and exit 0.
* ``hang``: every rank starts a round; the victim stops calling for three timeouts, then goes on. Every rank, the
  victim too (it reaches the failed barrier late), must get a ``cuep.EPError`` naming the victim (reason
  ``"timeout"``); after ``buf.reset()`` on every rank, rounds match the reference again.
* ``torch``: torch.distributed (gloo, ``env://`` with the launcher's variables) is initialised first; then
  ``cuep.init_distributed()`` must use its store (no port of cuep's own) and rounds match the reference.

Lines the test looks for: ``FAULT rank r: EPError rank=v reason=...`` and, last, ``PASS``.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # ep_check

import cuep  # noqa: E402
from ep_check import make_inputs, run_round  # noqa: E402

TIMEOUT_S = 2.0  # the buffer's: device-side waits and the barriers inside rounds


def fail(msg: str) -> None:
    print(f"FAILED: {msg}", flush=True)
    sys.exit(1)


def start_round(buf, cfg, rng, R: int, me: int):
    """The send half of a round on this rank (the inputs of every rank drawn, so the generators stay in step)."""
    import cupy

    xs, ids, ws = make_inputs(rng, cfg, [cfg.max_tokens_per_rank] * R)
    x, i, w = (cupy.asarray(a[me]) for a in (xs, ids, ws))
    pending = cuep.dispatch_async(buf, x, i, w)
    return pending


def expect_ep_error(fn, victim: int, reason: str, me: int, t0: float) -> cuep.EPError:
    try:
        fn()
    except cuep.EPError as e:
        print(f"FAULT rank {me}: EPError rank={e.rank} reason={e.reason} after {time.monotonic() - t0:.1f} s: {e}",
              flush=True)
        if (e.rank, e.reason) != (victim, reason):
            fail(f"the EPError names rank {e.rank} ({e.reason}), expected rank {victim} ({reason})")
        return e
    fail(f"no EPError naming rank {victim}")


def kill_mode(group, buf, cfg, rng, victim: int) -> None:
    R, me = group.n_ranks, group.ranks[0]
    pending = start_round(buf, cfg, rng, R, me)
    if me == victim:
        import cupy

        cupy.cuda.get_current_stream().synchronize()
        print(f"VICTIM rank {me}: SIGKILL now", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    expect_ep_error(lambda: cuep.dispatch_wait(pending), victim, "died", me, t0)
    # the buffer refuses rounds (reset() is collective and cannot succeed with a dead peer: it raises too)
    try:
        buf.check()
        fail("buf.check() passed after the failed round")
    except cuep.EPError as e:
        assert e.rank == victim, e
    try:
        buf.reset()
        fail("buf.reset() passed with a dead peer")
    except cuep.EPError as e:
        assert (e.rank, e.reason) == (victim, "died"), e
    buf.close()
    group.close()
    if group._opened:
        fail(f"IPC mappings still open after close: {group._opened}")
    print(f"CLOSED rank {me}: buffer and group closed, no IPC mapping left", flush=True)


def hang_mode(group, buf, cfg, rng, victim: int) -> None:
    R, me = group.n_ranks, group.ranks[0]
    pending = start_round(buf, cfg, rng, R, me)
    if me == victim:
        print(f"VICTIM rank {me}: stops calling for {3 * TIMEOUT_S:g} s", flush=True)
        time.sleep(3 * TIMEOUT_S)
    t0 = time.monotonic()
    expect_ep_error(lambda: cuep.dispatch_wait(pending), victim, "timeout", me, t0)
    try:  # a buffer whose round failed refuses the next one until reset()
        start_round(buf, cfg, rng, R, me)
        fail("a round started on a failed buffer")
    except cuep.EPError as e:
        assert e.rank == victim, e
    buf.reset()  # collective: every rank has seen the failure, so the ranks are in step again
    for i in range(3):
        run_round(buf, cfg, rng, [int(rng.integers(1, cfg.max_tokens_per_rank + 1)) for _ in range(R)], bare=True,
                  async_halves=bool(i % 2))
    print(f"rank {me}: 3 rounds after reset() match the reference", flush=True)
    group.barrier()
    buf.close()
    group.close()


def init_torch() -> None:
    import datetime

    import torch.distributed as dist  # torch only in this mode

    if "lo" in {name for _, name in socket.if_nameindex()}:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank on this host: loopback is enough
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=120))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mode", choices=["kill", "hang", "torch"], required=True)
    p.add_argument("--victim", type=int, default=2)
    p.add_argument("--seed", type=int, default=2024)
    a = p.parse_args(argv)

    if a.mode == "torch":
        init_torch()
    group = cuep.init_distributed(device=0, timeout_s=120)
    R, me = group.n_ranks, group.ranks[0]
    print(f"{group!r} rendezvous={type(group._comm).__name__}", flush=True)
    assert group.kind == "ipc" and (group.phase_barrier or R == 1), group
    if a.mode == "torch" and type(group._comm).__name__ != "_TorchStore":
        fail(f"torch.distributed is initialised, but cuep's rendezvous is {type(group._comm).__name__}")
    cfg = cuep.EPConfig(hidden=512, top_k=4, n_experts=12, max_tokens_per_rank=32, n_gpus_per_node=R)
    buf = cuep.Buffer(group, cfg, timeout_s=TIMEOUT_S)
    rng = np.random.default_rng(a.seed)  # the same on every rank
    run_round(buf, cfg, rng, [32] * R, bare=True)  # warm-up: compiles, first-launch barriers
    print(f"rank {me}: warm-up round matches the reference", flush=True)
    if a.mode == "kill":
        kill_mode(group, buf, cfg, rng, a.victim)
    elif a.mode == "hang":
        hang_mode(group, buf, cfg, rng, a.victim)
    else:
        for i in range(3):
            run_round(buf, cfg, rng, [int(rng.integers(0, 33)) for _ in range(R)], bare=True,
                      weights_at=["dispatch", "combine", None][i])
        print(f"rank {me}: 3 rounds through torch.distributed's store match the reference", flush=True)
        group.barrier()
        buf.close()
        group.close()
        import torch.distributed as dist

        dist.destroy_process_group()
    print("PASS", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

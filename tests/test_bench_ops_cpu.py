"""``benchmarks/bench_ops.py`` without a GPU: each case is built ``allocs`` times with the earlier builds still held
(so each lies elsewhere in memory), the reported time is the median of the builds' medians, and every build is
dropped and the memory pool emptied afterwards. The timing itself (CUDA events) is replaced by given numbers."""
from __future__ import annotations

import gc
import importlib.util
import sys
import weakref
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench_ops():
    spec = importlib.util.spec_from_file_location("bench_ops", ROOT / "benchmarks" / "bench_ops.py")
    mod = importlib.util.module_from_spec(spec)
    before = sys.modules.get("bench_ops")
    sys.modules["bench_ops"] = mod  # (its dataclass looks its module up)
    spec.loader.exec_module(mod)
    yield mod
    if before is None:
        sys.modules.pop("bench_ops", None)
    else:
        sys.modules["bench_ops"] = before


class _Pool:
    def __init__(self):
        self.frees = 0

    def free_all_blocks(self):
        self.frees += 1


def test_placements_are_held_timed_and_released(bench_ops, monkeypatch):
    medians = iter([171.0, 158.0, 157.5])
    alive, built = [], []

    def make():
        c = bench_ops.Case("quantize", "nvfp4 <- bf16", 32768, 7168, 3_000_000, lambda: None)
        # every earlier build is still alive when the next is made
        assert all(r() is not None for r in alive)
        alive.append(weakref.ref(c))
        built.append(id(c))
        return c

    seen = []

    def fake_measure(case, iters, flush):
        seen.append((id(case), iters, flush))
        return {"median_us": next(medians)}

    pool = _Pool()
    monkeypatch.setattr(bench_ops, "measure", fake_measure)
    monkeypatch.setattr(bench_ops.cupy, "get_default_memory_pool", lambda: pool)
    key, res = bench_ops.measure_placements(make, 3, 20, "flusher")
    gc.collect()

    assert key == ("quantize", "nvfp4 <- bf16", 32768, 7168)
    assert [s[0] for s in seen] == built and {s[1:] for s in seen} == {(20, "flusher")}
    assert res["alloc_us"] == [171.0, 158.0, 157.5]
    assert res["median_us"] == 158.0 and res["min_us"] == 157.5
    assert res["gbps"] == pytest.approx(3_000_000 / 158.0 / 1e3)
    assert res["bytes"] == 3_000_000 and res["iters"] == 20
    assert pool.frees == 1
    assert all(r() is None for r in alive)  # no build outlives the call


def test_one_placement_is_at_least_one(bench_ops, monkeypatch):
    n = []
    monkeypatch.setattr(bench_ops, "measure", lambda case, iters, flush: {"median_us": 10.0})
    monkeypatch.setattr(bench_ops.cupy, "get_default_memory_pool", _Pool)
    _, res = bench_ops.measure_placements(
        lambda: n.append(1) or bench_ops.Case("copy", "x", 1, 0, 100, lambda: None), 0, 5, None)
    assert len(n) == 1 and res["alloc_us"] == [10.0] and res["median_us"] == 10.0

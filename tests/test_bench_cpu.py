"""``cuep.bench`` without a GPU: byte accounting, the NCCL baseline's layout, timing statistics, report formatting,
argument parsing, plots; and (``gpu``) one ``python -m cuep.bench --quick`` run end to end.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import cuep
from cuep.bench import nccl, report, timing, traffic
from cuep.bench import __main__ as cli
from cuep.bench.floor import LAUNCH_FLOOR_CALL

REPO = Path(__file__).resolve().parents[1]


# ---- byte accounting ---------------------------------------------------------------------------------------------
# R = 2 ranks, E = 4 experts (L = 2 per rank: experts 0, 1 on rank 0; 2, 3 on rank 1), K = 2.
HAND_IDS = [np.array([[0, 1],    # token 0 -> experts on rank 0 only
                      [0, 2],    # token 1 -> ranks 0 and 1
                      [3, 2]],   # token 2 -> rank 1 only (two experts there: still one message)
                     np.int32),
            np.array([[2, 3],    # rank 1's token 0 -> rank 1 only
                      [1, 3]],   # token 1 -> ranks 0 and 1
                     np.int32)]
HAND_P = np.array([[2, 2],
                   [1, 2]])


def hand_cfg(fmt: str) -> cuep.EPConfig:
    return cuep.EPConfig(hidden=256, top_k=2, n_experts=4, max_tokens_per_rank=3, n_gpus_per_node=2,
                         dispatch_format=fmt)


def test_pair_counts_by_hand():
    np.testing.assert_array_equal(traffic.pair_counts(HAND_IDS, 4), HAND_P)
    np.testing.assert_array_equal(traffic.rank_mask(HAND_IDS[0], 4, 2), [[1, 0], [1, 1], [0, 1]])


@pytest.mark.parametrize("fmt, m_dispatch", [("bf16", 512), ("fp8", 256 + 2 * 4), ("nvfp4", 128 + 16),
                                             ("mxfp4", 128 + 8)])
def test_message_bytes_are_payload_plus_scales(fmt, m_dispatch):
    cfg = hand_cfg(fmt)
    assert traffic.dispatch_message_bytes(cfg) == m_dispatch
    assert traffic.combine_message_bytes(cfg) == 256 * 2  # bf16 partial sums


def test_traffic_by_hand():
    m, c = 264, 512  # fp8 H=256: 256 payload + 2 float32 scales; combine bf16: 512
    cfg = hand_cfg("fp8")
    assert traffic.dispatch_message_bytes(cfg) == m
    d = traffic.dispatch_traffic(HAND_P, m)
    # send: messages to the other rank only. rank 0 sends tokens 1, 2 to rank 1; rank 1 sends token 1 to rank 0
    np.testing.assert_array_equal(d.send, [2 * m, 1 * m])
    # algo: everything a rank receives, its own included: rank 0 gets 2 (own) + 1, rank 1 gets 2 + 2 (own)
    np.testing.assert_array_equal(d.algo, [3 * m, 4 * m])
    cb = traffic.combine_traffic(HAND_P, c)
    # combine returns one partial sum per received (token, rank): rank 0 returns 1 to rank 1, rank 1 returns 2
    np.testing.assert_array_equal(cb.send, [1 * c, 2 * c])
    np.testing.assert_array_equal(cb.algo, [3 * c, 4 * c])
    rt = traffic.op_traffic("roundtrip", HAND_P, m, c)
    np.testing.assert_array_equal(rt.send, d.send + cb.send)
    np.testing.assert_array_equal(rt.algo, d.algo + cb.algo)
    with pytest.raises(ValueError, match="op="):
        traffic.op_traffic("gather", HAND_P, m, c)


def test_one_rank_sends_nothing_over_nvlink():
    ids = [np.array([[0, 1], [2, 3], [1, 3]], np.int32)]
    P = traffic.pair_counts(ids, 4)
    np.testing.assert_array_equal(P, [[3]])
    t = traffic.op_traffic("roundtrip", P, 100, 10)
    np.testing.assert_array_equal(t.send, [0])
    np.testing.assert_array_equal(t.algo, [3 * 100 + 3 * 10])


@pytest.mark.parametrize("fmt, rows", [("bf16", (4, 6)), ("fp8", (8, 8))])
def test_expected_rows_by_hand(fmt, rows):
    cfg = hand_cfg(fmt)
    # rank 0: expert 0 <- (r0 t0, r0 t1), expert 1 <- (r0 t0, r1 t1); rank 1: experts 2, 3 get 3 rows each;
    # fp8 pads every group to a multiple of 4
    assert tuple(traffic.expected_rows(HAND_IDS, 4, r, cfg.fmt.row_align) for r in range(2)) == rows


def test_logical_bytes_match_targets_md(rng):
    """TARGETS.md: 405.9 GB/s "logical" over 524.7 us for the BF16 dispatch of N=4096, H=7168, K=8, E=256 on 4
    GPUs, i.e. about 213 MB per rank; our algorithm bytes for uniform routing must land there."""
    cfg = cuep.EPConfig(hidden=7168, top_k=8, n_experts=256, max_tokens_per_rank=4096, n_gpus_per_node=4)
    ids = [traffic.random_routing(rng, 4096, 256, 8) for _ in range(4)]
    t = traffic.dispatch_traffic(traffic.pair_counts(ids, 256), traffic.dispatch_message_bytes(cfg))
    deep_ep_bytes = 405.9e9 * 524.7e-6
    assert np.allclose(t.algo, deep_ep_bytes, rtol=0.02)
    # a quarter of them stay on the GPU: send bytes are about 3/4 (TARGETS.md's "about 305 GB/s" figure)
    assert np.allclose(t.send / t.algo, 0.75, atol=0.02)


def test_random_routing_has_distinct_experts(rng):
    ids = traffic.random_routing(rng, 100, 16, 8)
    assert ids.dtype == np.int32 and ids.shape == (100, 8)
    assert all(len(set(row)) == 8 for row in ids.tolist())
    assert ids.min() >= 0 and ids.max() < 16


# ---- the NCCL baseline's layout ----------------------------------------------------------------------------------
def _expected_dispatch(ids, rows, E, r):
    R = len(ids)
    L = E // R
    out = [rows[s][t] for l in range(L) for s in range(R) for t in range(len(ids[s]))
           if (ids[s][t] == r * L + l).any()]
    return np.array(out).reshape(-1, rows[0].shape[1])


@pytest.mark.parametrize("R, E, K, ns", [(1, 8, 2, [5]), (2, 8, 3, [4, 0]), (4, 16, 4, [7, 3, 0, 9]),
                                         (4, 32, 8, [20, 20, 20, 20])])
def test_nccl_layout_reproduces_dispatch_and_combine(R, E, K, ns, rng):
    ids = [traffic.random_routing(rng, n, E, K) for n in ns]
    ws = [rng.random((n, K)).astype(np.float32) for n in ns]
    lay = nccl.nccl_layout(ids, ws, E)
    np.testing.assert_array_equal(lay.counts, traffic.pair_counts(ids, E))
    H = 4
    x = [rng.standard_normal((n, H)).astype(np.float32) for n in ns]
    L = E // R
    # expert output of row (local expert l, source s, token t) = x[s][t] * (l + 1) + s, in expert-major order
    eo = []
    want_comb = [np.zeros((n, H), np.float32) for n in ns]
    for r in range(R):
        rows = []
        for l in range(L):
            for s in range(R):
                for t in range(ns[s]):
                    k = np.nonzero(ids[s][t] == r * L + l)[0]
                    if k.size:
                        v = x[s][t] * (l + 1) + s
                        rows.append(v)
                        want_comb[s][t] += ws[s][t, k[0]] * v
        eo.append(np.array(rows, np.float32).reshape(-1, H))
    got_d, got_c = nccl.simulate(lay, x, eo)
    for r in range(R):
        np.testing.assert_array_equal(got_d[r], _expected_dispatch(ids, x, E, r))
        assert len(lay.unperm[r]) == traffic.expected_rows(ids, E, r)
        np.testing.assert_array_equal(lay.row_expert[r], np.sort(lay.row_expert[r]))  # expert-major
    for s in range(R):
        np.testing.assert_allclose(got_c[s], want_comb[s], rtol=1e-5, atol=1e-5)


def test_nccl_blocks_offsets():
    """Block s -> d starts after s's earlier destinations in the send buffer and after d's earlier sources in the
    receive buffer; empty blocks are not posted."""
    counts = np.array([[2, 0, 3], [1, 4, 0], [0, 2, 5]])
    send = [SimpleNamespace(data=SimpleNamespace(ptr=1000 * (i + 1))) for i in range(3)]
    recv = [SimpleNamespace(data=SimpleNamespace(ptr=100000 * (i + 1))) for i in range(3)]
    blocks = nccl.NcclCase._blocks(counts, send, recv, 16)
    got = {(s, d): (sp, rp, n) for s, d, sp, rp, n in blocks}
    assert set(got) == {(0, 0), (0, 2), (1, 0), (1, 1), (2, 1), (2, 2)}
    assert got[0, 2] == (1000 + 2 * 16, 300000 + 0, 3 * 16)
    assert got[1, 0] == (2000 + 0, 100000 + 2 * 16, 16)
    assert got[2, 1] == (3000 + 0, 200000 + 4 * 16, 2 * 16)
    assert got[2, 2] == (3000 + 2 * 16, 300000 + 3 * 16, 5 * 16)


def test_message_rows_are_padded_to_16_bytes():
    assert nccl.message_row_bytes(14336) == 14336
    assert nccl.message_row_bytes(264) == 272
    assert nccl.message_row_bytes(1) == 16


# ---- timing statistics -------------------------------------------------------------------------------------------
def test_timing_statistics():
    # 2 series x 2 devices x 3 runs
    t = timing.Timing([[[10.0, 12.0, 11.0], [20.0, 5.0, 21.0]],
                       [[13.0, 12.0, 14.0], [22.0, 23.0, 6.0]]])
    assert t.n_devices == 2
    assert t.median_us == [12.0, 20.5]
    assert t.min_us == [10.0, 5.0]
    assert t.series_median_us == [[11.0, 20.0], [13.0, 22.0]]
    assert t.round_runs_us == [20.0, 12.0, 21.0, 22.0, 23.0, 14.0]
    assert t.round_us == 20.5
    assert math.isclose(t.noise, max(2 / 12.0, 2 / 20.5))
    d = t.as_dict()
    assert d["runs"] == 6 and d["gated"] is True


def test_timing_rejects_bad_arguments():
    with pytest.raises(ValueError, match="repeats"):
        timing.measure(lambda i: None, [0], repeats=0)
    with pytest.raises(ValueError, match="modes"):
        timing.measure(lambda i: None, [0], modes=("hot",))


# ---- report ------------------------------------------------------------------------------------------------------
def fake_record(system="cuep", op="dispatch", fmt="bf16", n=4096, us=(400.0, 410.0), send=(300e6, 310e6),
                algo=(400e6, 410e6), shapes=("prefill",), num_sms=132):
    cold = timing.Timing([[[u] * 3 for u in us], [[u] * 3 for u in us]])
    warm = timing.Timing([[[u * 0.9] * 3 for u in us], [[u * 0.9] * 3 for u in us]])
    return {"system": system, "op": op, "format": fmt, "n_tokens": n, "shapes": list(shapes), "hidden": 7168,
            "top_k": 8, "n_experts": 256, "n_ranks": len(us), "num_sms": num_sms if system == "cuep" else None,
            "bytes": {"send": list(send), "algo": list(algo)}, "cold": cold.as_dict(), "warm": warm.as_dict(),
            "check": "ok"}


CEIL = {"bytes": 1 << 30, "local_copy_gbps": [3900.0, 3950.0], "peer_copy_gbps": [[None, 397.0], [395.0, None]],
        "peer_copy_per_gpu_gbps": [397.0, 395.0], "all_pairs_gbps": [380.0, 378.0]}


def test_fill_derived_and_speedups():
    c = report.fill_derived(fake_record(), CEIL)
    n = report.fill_derived(fake_record(system="nccl", us=(800.0, 820.0)), CEIL)
    assert c["time_us"] == [400.0, 410.0] and c["round_us"] == 410.0
    assert c["send_gbps"] == pytest.approx([300e6 / 400e3, 310e6 / 410e3])  # bytes / us / 1e3 = GB/s
    assert c["algo_gbps"] == pytest.approx([1000.0, 1000.0])
    assert c["algo_gbps_warm"] == pytest.approx([1000.0 / 0.9, 1000.0 / 0.9])
    assert c["of_peer_copy"] == pytest.approx([750.0 / 397.0, (310e6 / 410e3) / 395.0])
    assert c["of_all_pairs"] == pytest.approx([750.0 / 380.0, (310e6 / 410e3) / 378.0])
    report.attach_speedups([c, n])
    assert c["speedup_vs_nccl"] == pytest.approx([2.0, 2.0])
    assert c["round_speedup_vs_nccl"] == pytest.approx(2.0)
    assert n["speedup_vs_nccl"] is None


def test_fill_derived_without_ceilings():
    c = report.fill_derived(fake_record(us=(100.0,), send=(0.0,), algo=(1e6,)), None)
    assert c["of_peer_copy"] is None and c["of_all_pairs"] is None
    assert c["send_gbps"] == [0.0]


def test_tables():
    recs = [report.fill_derived(fake_record(), CEIL), report.fill_derived(fake_record(system="nccl", us=(800.0, 820.0)),
                                                                         CEIL)]
    report.attach_speedups(recs)
    text = report.table(report.result_rows_per_gpu(recs, [0, 1]), report.RESULT_HEADER)
    lines = text.splitlines()
    assert len(lines) == 2 + 4  # header, rule, 2 records x 2 GPUs
    assert lines[0].split()[:4] == ["system", "op", "format", "N"]
    assert len({len(line) for line in lines}) == 1  # aligned columns
    assert "400.0" in lines[2] and "2.00" in lines[2] and "189%" in lines[2]
    summary = report.table(report.result_rows_summary(recs), report.SUMMARY_HEADER).splitlines()
    assert len(summary) == 4 and "410.0" in summary[2]
    assert "-" in summary[3].split()[-1]  # NCCL has no speed-up over itself
    assert "of all-pairs" in summary[0] and summary[2].split()[-2].endswith("%")  # send GB/s over the SM all-pairs
    ceil = report.ceilings_text(CEIL, [0, 1])
    assert "397" in ceil and "3900" in ceil and "from\\to" in ceil
    assert "peer ceilings skipped" in report.ceilings_text({"bytes": 1 << 20, "local_copy_gbps": [1.0],
                                                            "skipped_peers": "one GPU"}, [0])


def test_targets_text_only_for_the_target_shape():
    rec = report.fill_derived(fake_record(us=(400.0,) * 4, send=(1.0,) * 4, algo=(1.0,) * 4), None)
    t = report.targets_text([rec])
    assert t is not None and "420.0" in t and "yes" in t
    rec2 = dict(rec, n_ranks=2)
    assert report.targets_text([rec2]) is None


def test_json_is_strict_and_nan_free(tmp_path):
    rec = report.fill_derived(fake_record(us=(0.0, 100.0)), CEIL)  # 0 us -> NaN bandwidth
    path = report.write_json({"meta": {"x": np.int64(3)}, "results": [rec], "ceilings": CEIL}, tmp_path / "o")
    assert path == tmp_path / "o" / report.JSON_NAME
    doc = json.loads(path.read_text())  # strict JSON: would fail on NaN
    assert doc["meta"]["x"] == 3
    assert doc["results"][0]["send_gbps"][0] is None
    assert doc["ceilings"]["peer_copy_gbps"][0][0] is None


def _sweep_records():
    recs = []
    for system, scale in (("cuep", 1.0), ("nccl", 2.0)):
        for op in ("dispatch", "combine"):
            for fmt in ("bf16", "fp8"):
                for n in (1, 2, 4, 8):
                    recs.append(report.fill_derived(
                        fake_record(system=system, op=op, fmt=fmt, n=n, us=(scale * (10 + n),) * 2,
                                    send=(n * 1e5,) * 2, algo=(n * 1.3e5,) * 2, shapes=("sweep",)), CEIL))
    return recs


def test_plots_written(tmp_path):
    pytest.importorskip("matplotlib")
    paths = report.plot_sweep(_sweep_records(), tmp_path, CEIL, title="test")
    assert [p.name for p in paths] == list(report.PLOT_NAMES)
    for p in paths:
        assert p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG"


def test_plots_skipped_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    msg = report.plot_sweep(_sweep_records(), tmp_path, CEIL)
    assert isinstance(msg, str) and "matplotlib" in msg
    assert not list(tmp_path.iterdir())


def test_plots_need_a_sweep(tmp_path):
    pytest.importorskip("matplotlib")
    msg = report.plot_sweep([report.fill_derived(fake_record(), CEIL)], tmp_path, CEIL)
    assert isinstance(msg, str) and "sweep" in msg


# ---- command line ------------------------------------------------------------------------------------------------
def test_default_plan():
    plan = cli.make_plan([])
    assert (plan.hidden, plan.top_k, plan.n_experts) == (7168, 8, 256)
    assert plan.formats == ["bf16", "fp8", "nvfp4", "mxfp4"]
    assert plan.shapes == {"prefill": 4096, "decode": 128}
    assert plan.sweep_n == [2**i for i in range(14)]
    assert plan.ops == ["dispatch", "combine", "roundtrip"] and plan.num_sms == [None]
    assert plan.nccl and plan.ceilings and plan.gate and plan.devices is None and not plan.dry_run
    pts = plan.points()
    assert [p["n"] for p in pts[:2]] == [4096, 128]  # standard shapes first
    assert pts[0]["shapes"] == ["prefill", "sweep"] and pts[0]["repeats"] == plan.repeats
    assert [p["n"] for p in pts[2:]] == [n for n in plan.sweep_n if n not in (128, 4096)]
    assert all(p["repeats"] == plan.sweep_repeats for p in pts[2:])
    # per format: cuep 3 ops; NCCL 3 ops + 2 a2a-only at standard shapes
    assert plan.n_measurements(False) == 14 * 4 * 3
    assert plan.n_measurements(True) == 14 * 4 * 6 + 2 * 4 * 2


def test_quick_and_overrides():
    plan = cli.make_plan(["--quick", "--formats", "bf16,fp8", "--no-sweep", "--num-sms", "8", "16", "--repeats", "7",
                          "--devices", "0,1", "--out", "/tmp/x", "--no-nccl", "--no-gate"])
    assert plan.quick and plan.hidden == 1024 and plan.formats == ["bf16", "fp8"] and plan.sweep_n == []
    assert plan.num_sms == [8, 16] and plan.repeats == 7 and plan.devices == [0, 1] and plan.out == "/tmp/x"
    assert not plan.nccl and not plan.gate
    assert plan.n_measurements(False) == 2 * 2 * 2 * 3  # 2 shapes x 2 formats x 2 SM counts x 3 ops
    assert plan.small_batch_tokens is None
    assert cli.make_plan(["--small-batch-tokens", "0"]).small_batch_tokens == 0


@pytest.mark.parametrize("tokens, want", [(["1:8"], [1, 2, 4, 8]), (["3:20"], [4, 8, 16]), (["5", "1:2,7"], [1, 2, 5, 7])])
def test_sweep_parsing(tokens, want):
    assert cli.parse_sweep(tokens) == want


def test_shape_parsing():
    assert cli.parse_shapes(["prefill", "big=8192", "64"]) == {"prefill": 4096, "big": 8192, "N64": 64}
    plan = cli.make_plan(["--shapes", "none"])  # the sweep alone
    assert plan.shapes == {} and all(not p["standard"] for p in plan.points()) and len(plan.points()) == 14


@pytest.mark.parametrize("argv", [["--formats", "int4"], ["--ops", "gather"], ["--sweep-n", "8:2"],
                                  ["--shapes", "huge"], ["--repeats", "0"], ["--devices", "0", "0"],
                                  ["--no-sweep", "--shapes", ""], ["--no-sweep", "--shapes", "none"],
                                  ["--num-sms", "0"], ["--small-batch-tokens", "-1"]])
def test_bad_arguments_exit_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.make_plan(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_dry_run_needs_no_gpu(capsys):
    assert cli.main(["--dry-run", "--devices", "0", "1", "2", "3"]) == 0
    out = capsys.readouterr().out
    assert "H=7168, K=8, E=256, 4 rank(s)" in out and "measurements: 352" in out and "GiB per GPU" in out


def test_without_gpu_the_cli_says_so(capsys):
    from conftest import N_GPUS

    if N_GPUS:
        pytest.skip("a GPU is visible")
    assert cli.main(["--quick"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


def test_from_json_reprints_and_plots(tmp_path, capsys):
    """A saved bench.json is rendered again without a GPU (tables always, plots when matplotlib is there)."""
    import importlib.util

    recs = _sweep_records() + [report.fill_derived(fake_record(), CEIL)]
    report.attach_speedups(recs)
    doc = {"meta": {"devices": [0, 1], "n_ranks": 2, "gpus": [{"name": "Fake GPU"}] * 2, "notes": ["a note"]},
           "config": {"hidden": 7168, "top_k": 8, "n_experts": 256}, "ceilings": CEIL, "results": recs,
           "errors": []}
    path = report.write_json(doc, tmp_path / "run")
    assert cli.main(["--from-json", str(path), "--out", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "standard shapes, per GPU" in out and "sweep (round time" in out and "note: a note" in out
    assert "peer copy GB/s" in out
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in out
    else:
        assert all((tmp_path / "plots" / name).exists() for name in report.PLOT_NAMES)


def test_progress_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    p = cli.Progress(2)
    p.update("a")
    p.write("hello")
    p.update("b")
    p.close()
    err = capsys.readouterr().err
    assert "[1/2] a" in err and "[2/2] b" in err and "hello" in err


# ---- end to end on a GPU -----------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cli_quick_run_end_to_end(tmp_path):
    from conftest import N_GPUS

    out = tmp_path / "bench"
    n_dev = max(k for k in (1, 2, 4, 8) if k <= max(N_GPUS, 1))  # --quick has E = 64: 1, 2, 4 or 8 ranks
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "cuep.bench", "--quick", "--out", str(out),
                          "--devices", *(str(d) for d in range(n_dev))], capture_output=True, text=True,
                         timeout=1500, cwd=REPO, env=env)
    assert res.returncode == 0, f"stdout:\n{res.stdout[-5000:]}\nstderr:\n{res.stderr[-5000:]}"
    doc = json.loads((out / report.JSON_NAME).read_text())
    assert set(doc) >= {"meta", "config", "ceilings", "nccl", "results", "errors"}
    assert doc["errors"] == []
    n = doc["meta"]["n_ranks"]
    assert {"devices", "gpus", "notes", "gated", "cuda_runtime"} <= set(doc["meta"])
    assert "local_copy_gbps" in doc["ceilings"]
    systems = {r["system"] for r in doc["results"]}
    assert "cuep" in systems and (("nccl" in systems) == (n > 1 and "version" in doc["nccl"]))
    keys = {"system", "op", "format", "n_tokens", "shapes", "num_sms", "bytes", "cold", "warm", "time_us", "round_us",
            "noise", "send_gbps", "algo_gbps", "of_peer_copy", "of_all_pairs", "speedup_vs_nccl", "check"}
    for r in doc["results"]:
        assert keys <= set(r), keys - set(r)
        assert r["check"] == "ok"
        assert len(r["time_us"]) == n and all(t > 0 for t in r["time_us"])
        assert all(v > 0 for v in r["algo_gbps"])
    cuep_ops = {(r["op"], r["format"]) for r in doc["results"] if r["system"] == "cuep"}
    assert cuep_ops == {(op, f) for op in ("dispatch", "combine", "roundtrip") for f in ("bf16", "fp8", "nvfp4", "mxfp4")}
    if n == 1:
        assert any("one GPU" in note for note in doc["meta"]["notes"])
        assert "one GPU" in res.stdout


# ---- the single-GPU floor report (--floor) -----------------------------------------------------------------------
# One rank, H = 256, K = 2, E = 4; tokens: [0, 1], [0, 2], [3, 0] -> expert counts 3, 1, 1, 1 (6 rows).
FLOOR_IDS = np.array([[0, 1], [0, 2], [3, 0]], np.int32)


def floor_cfg(fmt: str) -> cuep.EPConfig:
    return cuep.EPConfig(hidden=256, top_k=2, n_experts=4, max_tokens_per_rank=3, n_gpus_per_node=1,
                         dispatch_format=fmt)


@pytest.mark.parametrize("fmt, payload, scales", [("bf16", 512, 0), ("fp8", 256, 8), ("nvfp4", 128, 16),
                                                  ("mxfp4", 128, 8)])
def test_floor_bytes_of_dispatch_by_hand(fmt, payload, scales):
    b = traffic.floor_bytes("dispatch", floor_cfg(fmt), FLOOR_IDS)
    r16 = lambda n: -(-n // 16) * 16  # noqa: E731
    assert b["rows"] == 6
    # x [3, 256] bf16 + ids and weights [3, 2] x 4 bytes
    assert b["read"] == r16(3 * 256 * 2 + 2 * 3 * 2 * 4)
    meta = 4 * 5 + 4 * 4 + (4 * 4 if fmt in ("nvfp4", "mxfp4") else 0)  # row_offsets, expert_ids, scales_offsets
    assert b["write"] == r16(6 * (payload + scales + 8) + meta)
    if fmt == "bf16":
        assert b["write_layout"] == b["write"] and b["padded_rows"] == 6 and b["scale_tiles"] == 0
    elif fmt == "fp8":  # every expert's rows padded to 4: 4 + 4 + 4 + 4 = 16 rows
        assert b["padded_rows"] == 16
        assert b["write_layout"] == r16(16 * (payload + scales + 8) + meta)
    else:  # one 128-row tile per expert that has rows, k_tiles = ceil(n_scales / 4) blocks of 512 bytes each
        n_scales = 256 // (16 if fmt == "nvfp4" else 32)
        k_tiles = -(-n_scales // 4)
        assert b["scale_tiles"] == 4 and b["padded_rows"] == 6
        assert b["write_layout"] == r16(6 * (payload + 8) + 4 * k_tiles * 512 + meta)


def test_floor_bytes_of_combine_by_hand():
    b = traffic.floor_bytes("combine", floor_cfg("bf16"), FLOOR_IDS)
    assert b["read"] == 6 * (256 * 2 + 8) and b["write"] == 3 * 256 * 2 == b["write_layout"]
    assert b["rows"] == 6


def test_floor_bytes_refuses_several_ranks_and_other_ops():
    with pytest.raises(ValueError, match="one rank"):
        traffic.floor_bytes("dispatch", hand_cfg("bf16"), HAND_IDS[0])
    with pytest.raises(ValueError, match="op="):
        traffic.floor_bytes("roundtrip", floor_cfg("bf16"), FLOOR_IDS)
    empty = traffic.floor_bytes("dispatch", floor_cfg("fp8"), np.zeros((0, 2), np.int32))
    assert empty["rows"] == 0 and empty["read"] == 0 and empty["padded_rows"] == 0


def test_floor_bytes_at_the_issue_shape_match_the_measured_floors(rng):
    """H = 7168, K = 8, E = 256, N = 4096: the floors of issue 24 (H200) were about 4 TB/s for every op, so the
    byte counts must be those of its table: e.g. bf16 dispatch about 529 MB, nvfp4 about 191 MB."""
    ids = traffic.random_routing(rng, 4096, 256, 8)
    got = {}
    for fmt in ("bf16", "fp8", "nvfp4", "mxfp4"):
        cfg = cuep.EPConfig(hidden=7168, top_k=8, n_experts=256, max_tokens_per_rank=4096, n_gpus_per_node=1,
                            dispatch_format=fmt)
        b = traffic.floor_bytes("dispatch", cfg, ids)
        got[fmt] = (b["read"] + b["write"]) / 1e6
    cb = traffic.floor_bytes("combine", cuep.EPConfig(hidden=7168, top_k=8, n_experts=256, max_tokens_per_rank=4096,
                                                      n_gpus_per_node=1), ids)
    assert got == pytest.approx({"bf16": 529.0, "fp8": 301.5, "nvfp4": 191.4, "mxfp4": 184.0}, rel=0.01)
    assert (cb["read"] + cb["write"]) / 1e6 == pytest.approx(528.7, rel=0.01)


def test_floor_kernel_blocks():
    from cuep.bench import kernels

    assert kernels.floor_blocks(0, 0, 132) == 1
    assert kernels.floor_blocks(16, 1 << 20, 132) == -(-(1 << 16) // (512 * 4))
    assert kernels.floor_blocks(1 << 30, 16, 132) == 4 * 132  # capped at 4 blocks per SM


def test_host_stats():
    from cuep.bench import floor

    s = floor.host_stats([5.0, 1.0, 3.0, 2.0, 4.0, 10.0, 6.0, 7.0, 8.0, 9.0])
    assert s["median_us"] == 5.5 and s["min_us"] == 1.0 and s["calls"] == 10
    assert s["p10_us"] == 1.0 and s["p90_us"] == 9.0 and s["mean_us"] == 5.5
    assert floor.host_stats([])["median_us"] is None


def fake_floor_record(op="dispatch", fmt="fp8", n=128, us=(20.0, 15.0), floor_us=(6.0, 5.0), layout_us=7.5,
                      host_us=40.0, blocked=False, chain_us=None, launch_us=None):
    from cuep.bench import floor

    t = lambda v: timing.Timing([[[v] * 3], [[v] * 3]]).as_dict()  # noqa: E731
    rec = {"op": op, "format": fmt, "n_tokens": n, "check": "ok",
           "bytes": {"read": 1_000_000, "write": 3_000_000, "write_layout": 4_000_000},
           "gpu": {"cold": t(us[0]), "warm": t(us[1])}, "floor": {"cold": t(floor_us[0]), "warm": t(floor_us[1])},
           "floor_layout": {"cold": t(layout_us), "warm": t(layout_us)} if layout_us else None,
           "host": floor.host_stats([host_us] * 4) | {"blocked": blocked}}
    if launch_us:  # (host_cost with a launch_ref)
        rec["host"] |= {"launch_us": launch_us, "x_launch": host_us / launch_us}
    if chain_us:  # (op, floor) us per call, CHAIN_CALLS calls a run
        calls = floor.CHAIN_CALLS
        rec["chain"] = {"calls": calls, "warm": t(chain_us[0] * calls), "floor_warm": t(chain_us[1] * calls)}
    return floor.fill_derived(rec)


def test_floor_back_to_back_fields_and_table():
    from cuep.bench import floor

    r = fake_floor_record(chain_us=(12.0, 4.0))
    assert r["chain_us"] == pytest.approx(12.0) and r["chain_floor_us"] == pytest.approx(4.0)
    assert r["x_floor_chain"] == pytest.approx(3.0)
    old = fake_floor_record()  # (a JSON from before the back-to-back timing)
    assert old["chain_us"] is None and old["x_floor_chain"] is None
    rows = floor.chain_rows([r, old])
    assert len(rows) == 1 and rows[0][:3] == ("dispatch", "fp8", 128) and rows[0][-1] == "3.00"
    assert len(floor.CHAIN_HEADER) == len(rows[0])


def test_floor_derived_fields_and_table():
    from cuep.bench import floor

    r = fake_floor_record()
    assert (r["us_cold"], r["us_warm"], r["floor_us_cold"], r["floor_us_warm"]) == (20.0, 15.0, 6.0, 5.0)
    assert r["x_floor_cold"] == pytest.approx(20 / 6) and r["x_floor_warm"] == pytest.approx(3.0)
    assert r["layout_us_warm"] == 7.5 and r["x_layout_warm"] == pytest.approx(2.0)
    assert r["floor_gbps_warm"] == pytest.approx(4e6 / 5e3) and r["host_us"] == 40.0
    bf = fake_floor_record(fmt="bf16", layout_us=None, blocked=True)
    assert bf["layout_us_warm"] == 5.0 and bf["x_layout_warm"] == pytest.approx(3.0)
    lines = report.table(floor.floor_rows([r, bf]), floor.FLOOR_HEADER).splitlines()
    assert len(lines) == 4 and len({len(line) for line in lines}) == 1
    assert lines[0].split()[:3] == ["op", "format", "N"] and "x floor warm" in lines[0] and "host us" in lines[0]
    assert "3.33" in lines[2] and "3.00" in lines[2] and "2.00" in lines[2] and lines[2].rstrip().endswith("40.0")
    assert "(blocked)" in lines[3]
    ref = fake_floor_record(launch_us=8.0)  # host 40 us against a bare launch of 8 in the same batches
    row = floor.floor_rows([ref])[0]
    assert row[-1] == "40.0 (5.0x launch)"


def test_host_rows_show_the_call_against_a_bare_launch():
    """The host table gives each call's median over the bare launch timed beside it ("-" where there was none)."""
    from cuep.bench import floor

    st = floor.host_stats([12.0, 14.0]) | {"blocked": False}
    with_ref = {"call": "cuep.dispatch", "format": "fp8", "n_tokens": 1} | st | {"launch_us": 4.0, "x_launch": 3.25}
    bare = {"call": floor.LAUNCH_FLOOR_CALL, "format": "-", "n_tokens": 0} | st
    rows = floor.host_rows([with_ref, bare])
    assert len(floor.HOST_HEADER) == len(rows[0]) and floor.HOST_HEADER[4] == "x launch"
    assert rows[0][3:5] == ("13.0", "3.25") and rows[1][4] == "-"


def test_floor_report_prints_every_table(capsys):
    from cuep.bench import floor

    host = [{"call": "cuep.dispatch_async", "format": "fp8", "n_tokens": 128} | floor.host_stats([12.0, 14.0])
            | {"blocked": False}]
    seg = lambda name, c, w: {"name": name, "cold_us": c, "warm_us": w}  # noqa: E731
    phases = [{"op": "dispatch", "format": "fp8", "n_tokens": 128, "split": "phases",
               "segments": [seg("notify", 3.0, 2.5), seg("send", 6.0, 5.0), seg("recv", 9.0, 8.0)],
               "total_cold_us": 18.0, "total_warm_us": 15.5}]
    doc = {"meta": {"notes": ["one rank"], "gpus": [{"name": "Fake GPU"}], "python_call_ns": [21.4, 36.6]},
           "config": {"hidden": 7168, "top_k": 8, "n_experts": 256},
           "results": [fake_floor_record(chain_us=(12.0, 4.0))],
           "host": host, "phases": phases, "errors": []}
    floor.print_report(doc)
    out = capsys.readouterr().out
    assert "note: one rank" in out and "cuep.dispatch_async" in out and "15.5" in out and "notify" in out
    assert "an empty Python call 21 / 37 ns before / after" in out
    assert out.index("host cost") < out.index("per launch") < out.index("back to back") < out.index("Fake GPU")
    assert out.rstrip().splitlines()[-1].split()[:3] == ["dispatch", "fp8", "128"]


def test_floor_plan_defaults_and_options():
    plan = cli.make_plan(["--floor"])
    assert plan.floor and plan.floor_n == [1, 32, 128, 4096] and plan.ops == ["dispatch", "combine"]
    assert (plan.hidden, plan.top_k, plan.n_experts) == (7168, 8, 256) and plan.host and not plan.phases
    assert (plan.host_calls, plan.host_batches) == (32, 8) and plan.max_tokens is None
    from cuep.bench import floor

    assert floor.max_tokens(plan) == 4096 and floor.buffer_formats(plan) == ["bf16", "fp8", "nvfp4", "mxfp4"]
    assert floor.ops_of(plan)[-1] == ("combine", "bf16") and len(floor.ops_of(plan)) == 5
    q = cli.make_plan(["--floor", "--quick", "--phases", "--formats", "fp8", "--ops", "combine", "dispatch",
                       "--no-host", "--max-tokens", "128"])
    assert q.floor_n == [1, 16, 64] and q.phases_n == [16] and not q.host and q.max_tokens == 128
    assert floor.buffer_formats(q) == ["fp8", "bf16"]  # combine runs after a bf16 dispatch
    assert floor.ops_of(q) == [("dispatch", "fp8"), ("combine", "bf16")]
    assert cli.make_plan(["--floor", "--floor-n", "1:8", "64"]).floor_n == [1, 2, 4, 8, 64]


@pytest.mark.parametrize("argv", [["--floor", "--floor-n", "0"], ["--floor", "--ops", "roundtrip"],
                                  ["--floor", "--phases", "--phases-n", "64", "--floor-n", "128"],
                                  ["--floor", "--max-tokens", "64"], ["--floor", "--host-calls", "0"]])
def test_bad_floor_arguments_exit_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.make_plan(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_floor_dry_run_needs_no_gpu(capsys):
    assert cli.main(["--floor", "--dry-run", "--phases"]) == 0
    out = capsys.readouterr().out
    assert "H=7168, K=8, E=256, one rank" in out and "Buffers sized for 4096 tokens" in out
    assert "measurements: 20 (op, format, N) cases" in out and "phases: N = 128" in out
    # the bf16 dispatch at N = 4096 reads x, ids, weights and writes 32768 rows of 14336 + 8 bytes and the groups
    row = next(line for line in out.splitlines() if line.split()[:3] == ["dispatch", "bf16", "4096"])
    assert row.split()[3:5] == [str(4096 * 7168 * 2 + 2 * 4 * 4096 * 8),
                                str(-(-(32768 * (14336 + 8) + 4 * 257 + 4 * 256) // 16) * 16)]


def test_floor_without_gpu_says_so(capsys):
    from conftest import N_GPUS

    if N_GPUS:
        pytest.skip("a GPU is visible")
    assert cli.main(["--floor", "--quick"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


def test_floor_from_json_reprints(tmp_path, capsys):
    from cuep.bench import floor

    doc = {"meta": {"notes": [], "gpus": [{"name": "Fake GPU"}]}, "config": {"hidden": 1, "top_k": 1, "n_experts": 1},
           "results": [fake_floor_record()], "host": [], "phases": [], "errors": []}
    path = report.write_json(doc, tmp_path, floor.JSON_NAME)
    assert path.name == "floor.json"
    assert cli.main(["--floor", "--from-json", str(path)]) == 0
    assert "Fake GPU" in capsys.readouterr().out


@pytest.mark.gpu
def test_cli_floor_quick_end_to_end(tmp_path):
    """``--floor --quick --phases`` on one GPU: every case checked, timed, floored, host-costed, split."""
    out = tmp_path / "floor"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "cuep.bench", "--floor", "--quick", "--phases", "--out", str(out)],
                         capture_output=True, text=True, timeout=1500, cwd=REPO, env=env)
    assert res.returncode == 0, f"stdout:\n{res.stdout[-5000:]}\nstderr:\n{res.stderr[-5000:]}"
    doc = json.loads((out / "floor.json").read_text())
    assert doc["errors"] == []
    assert {(r["op"], r["format"]) for r in doc["results"]} == \
        {("dispatch", f) for f in ("bf16", "fp8", "nvfp4", "mxfp4")} | {("combine", "bf16")}
    assert len(doc["results"]) == 15
    for r in doc["results"]:
        assert r["check"] == "ok"
        assert all(r[k] > 0 for k in ("us_cold", "us_warm", "floor_us_cold", "floor_us_warm", "layout_us_warm",
                                      "host_us"))
        assert not r["host"]["blocked"]
        assert (r["floor_layout"] is None) == (r["op"] == "combine" or r["format"] == "bf16")
    calls = {h["call"] for h in doc["host"]}
    assert calls == {"cuep.dispatch", "cuep.combine", "cuep.dispatch_async", "cuep.dispatch_wait",
                     "cuep.combine_async", "cuep.combine_wait", "cuep.ops.quantize", "cuep.ops.dequantize",
                     "cuep.ops.swizzle_block_scales", "cuep.ops.fused_silu", LAUNCH_FLOOR_CALL}
    assert all(not h["blocked"] and h["calls"] == 16 for h in doc["host"])
    for h in doc["host"]:  # every call beside a bare launch of its own batches; the bare launch's row alone
        if h["call"] == LAUNCH_FLOOR_CALL:
            assert "x_launch" not in h
        else:
            assert h["launch_us"] > 0 and h["x_launch"] == pytest.approx(h["median_us"] / h["launch_us"])
    assert {(p["op"], p["split"]) for p in doc["phases"]} == {(op, s) for op in ("dispatch", "combine")
                                                               for s in ("fused", "halves", "phases")}
    assert all(s["warm_us"] > 0 for p in doc["phases"] for s in p["segments"])
    assert res.stdout.rstrip().splitlines()[-1].startswith("wrote ")


def test_nodes_prints_the_across_nodes_model(capsys):
    """--nodes: the network model of a multi-node round (no GPU), dedup beside no dedup, for the asked node counts."""
    from cuep.bench.__main__ import main

    assert main(["--nodes", "2", "4", "--hidden", "4096"]) == 0
    out = capsys.readouterr().out
    assert "H = 4096" in out and "| 2 x 8 |" in out and "| 4 x 8 |" in out and "| 8 x 8 |" not in out
    assert "dedup" in out


def test_launch_floor_kernel_takes_a_struct_the_size_of_the_dispatchs():
    """The host table's "launch only" row launches an empty kernel shaped like the dispatch: the same struct size."""
    import re

    from cuep import params
    from cuep.bench import kernels

    src = (Path(cuep.__file__).parent / "cuda_src" / "bench.cu").read_text()
    words = int(re.search(r"struct LaunchFloorArgs \{\s*long long words\[(\d+)\];", src).group(1))
    assert kernels.LAUNCH_FLOOR_BYTES == 8 * words == params.DISPATCH_PARAMS_DTYPE.itemsize


def benchmark_module(name: str):
    """benchmarks/<name>.py imported as a module (the scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_host_python_runs_without_a_gpu(capsys):
    """benchmarks/host_python.py (the Python part of a call's host cost, launches stubbed) runs on a CPU machine
    and prints every case; its stand-ins are taken out again (the real cuep.ep still sees CuPy's ndarray)."""
    from cuep import _kernels, ep

    mod = benchmark_module("host_python")
    saved = (ep._cupy, ep._ND, ep._runtime, ep._kernel, _kernels._launch_raw)
    from cuep import ops
    caches = (ops._prepared, ops._quantize_plans, ops._silu_plans, ops._dequantize_plans,
              ops._swizzle_plans)  # (the stand-in launches must not stay)
    saved_ops = (ops._cupy, ops._ND, ops._runtime) + tuple(dict(c) for c in caches)
    try:
        assert mod.main(["--reps", "3", "--runs", "1"]) == 0
    finally:
        ep._cupy, ep._ND, ep._runtime, ep._kernel, _kernels._launch_raw = saved
        ops._cupy, ops._ND, ops._runtime = saved_ops[:3]
        for c, kept in zip(caches, saved_ops[3:]):
            c.clear()
            c.update(kept)
    out = capsys.readouterr().out
    for case in ("bf16 dispatch + combine", "bf16 dispatch_async + dispatch_wait", "nvfp4 dispatch + combine",
                 "ops.quantize fp8 (out=)", "ops.quantize nvfp4 (out=)", "ops.fused_silu fp8 (out=)",
                 "ops.fused_silu nvfp4 (out=)", "ops.dequantize nvfp4 (out=)", "ops.swizzle_block_scales nvfp4 (out=)"):
        assert case in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("bf16 ", "nvfp4 ", "ops."))]
    assert len(rows) == 11 and all(float(r[-1]) > 0 for r in rows)


def test_python_call_ns_times_an_empty_call():
    from cuep.bench import floor

    ns = floor.python_call_ns(reps=2000, repeat=3)
    assert type(ns) is float and 1.0 < ns < 10_000.0  # an empty call: tens of ns on any host


def test_eager_chain_checks_its_arguments_before_any_gpu_work(capsys):
    """benchmarks/eager_chain.py refuses bad counts and token numbers (naming them) before it imports CuPy's GPU
    side or builds a Buffer."""
    mod = benchmark_module("eager_chain")
    for bad in (["--calls", "0"], ["--repeats", "0"], ["--tokens", "0"], ["--tokens", "4097"]):
        with pytest.raises(SystemExit) as e:
            mod.main(bad)
        assert e.value.code == 2
        assert "--calls and --repeats must be >= 1, --tokens in [1, 4096]" in capsys.readouterr().err


def test_launch_gpu_checks_its_arguments_before_any_gpu_work(capsys):
    """benchmarks/launch_gpu.py refuses a repeat count below 1 (naming it) before it imports CuPy's GPU side."""
    mod = benchmark_module("launch_gpu")
    with pytest.raises(SystemExit) as e:
        mod.main(["--reps", "0"])
    assert e.value.code == 2
    assert "--reps 0: must be >= 1" in capsys.readouterr().err


def test_launch_gpu_probes_compile_for_sm90(tmp_path):
    """The probe kernels of benchmarks/launch_gpu.py compile for sm_90, their parameter block the size of cuep's
    DispatchParams, one kernel per number of parameter lines read."""
    import shutil
    import subprocess

    from cuep import params

    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        pytest.skip("nvcc not found")
    mod = benchmark_module("launch_gpu")
    assert 8 * mod.param_words() == params.DISPATCH_PARAMS_DTYPE.itemsize
    src = tmp_path / "probe.cu"
    src.write_text(mod.SRC + f"static_assert(sizeof(Params) == {params.DISPATCH_PARAMS_DTYPE.itemsize}, \"size\");\n")
    res = subprocess.run([nvcc, "-cubin", "-arch=sm_90", "--std=c++17", f"-DPARAM_WORDS={mod.param_words()}", "-o",
                          str(tmp_path / "p.cubin"), str(src)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert all(f"lg_lines_{k}" in mod.SRC for k in mod.PARAM_LINES)
    assert 8 * (max(mod.PARAM_LINES) - 1) < mod.param_words()  # (line i is read at word 8 i)

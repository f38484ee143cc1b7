"""benchmarks/ncu_profile.py without a GPU: its parser and derived figures on Nsight Compute reports saved from
real runs (docs/bench: the H200 fused SwiGLU, the H100 one-rank decode), its command lines, its argument checks."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import ncu_profile as npf  # noqa: E402

SILU = ROOT / "docs/bench/h200x1/a079998/ncu_silu_nvfp4.txt"
DECODE = ROOT / "docs/bench/h100x1/a079998/ncu_decode_bf16_1.txt"


def test_parse_saved_silu_report():
    (k,) = npf.parse_report(SILU.read_text())
    assert (k.name, k.grid, k.block) == ("fused_silu_nvfp4_bf16", 264, 256)
    m = k.metrics
    assert m["smsp__inst_executed.sum"] == 285_138_018
    assert m["sm__cycles_elapsed.avg"] == pytest.approx(674_456.95)
    assert m["launch__block_size"] == 256 and m["launch__registers_per_thread"] == 128
    assert m["smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio"] == 0
    assert len([n for n in m if n.startswith(npf.STALL)]) == 19


def test_summary_of_the_silu_report():
    (k,) = npf.parse_report(SILU.read_text())
    s = npf.summarize(k, sms=132)
    assert s["instructions_per_warp"] == pytest.approx(285_138_018 / (264 * 256 // 32))
    assert s["issue_bound_cycles"] == pytest.approx(285_138_018 / (4 * 132))
    assert s["of_issue_bound"] == pytest.approx(285_138_018 / (4 * 132) / 674_456.95)
    assert 0.79 < s["of_issue_bound"] < 0.81
    ratios = [v for n, v in k.metrics.items() if n.startswith(npf.STALL)]
    assert s["cycles_per_instruction"] == pytest.approx(sum(ratios))
    assert list(s["stalls"])[:2] == ["not_selected", "math_pipe_throttle"]
    assert "selected" not in s["stalls"] and all(v >= 0.05 for v in s["stalls"].values())
    assert s["us"] == pytest.approx(347.46) and s["issue_busy_pct"] == pytest.approx(82.99)


def test_parse_saved_decode_report_two_kernels():
    ks = npf.parse_report(DECODE.read_text())
    assert [k.name for k in ks] == ["cuep_dispatch_local_bf16_from_bf16", "cuep_combine_local_bf16"]
    assert all((k.grid, k.block) == (132, 512) for k in ks)
    d, c = (npf.summarize(k, 132) for k in ks)
    assert d["instructions_per_warp"] == pytest.approx(977_063 / (132 * 16))
    assert c["warp_instructions"] == 273_672
    assert max(c["stalls"], key=c["stalls"].get) == "imc_miss"
    assert d["issue_busy_pct"] is None  # not collected in that run: shown as "-"
    table = npf.format_table([{"case": "bf16 N=1", **d}, {"case": "bf16 N=1", **c}])
    assert "cuep_combine_local_bf16" in table and "imc_miss 3.27" in table and "462.6" in table


def test_summary_names_a_missing_metric():
    k = npf.KernelReport("k", 1, 32, {"smsp__inst_executed.sum": 10.0})
    with pytest.raises(KeyError, match="sm__cycles_elapsed.avg"):
        npf.summarize(k, 132)


def test_parse_ignores_metrics_before_a_kernel_and_other_lines():
    text = "    smsp__inst_executed.sum   inst   5\n==PROF== x\n  kern (2, 1, 1)x(64, 1, 1), Context 1\n" \
           "    sm__cycles_elapsed.avg   cycle   1,234.5\n    Metric Name   Metric Unit Metric Value\n"
    (k,) = npf.parse_report(text)
    assert (k.grid, k.block, k.metrics) == (2, 64, {"sm__cycles_elapsed.avg": 1234.5})


def test_dry_run_commands(capsys, monkeypatch):
    monkeypatch.setattr(npf, "find_ncu", lambda: "/opt/ncu")
    assert npf.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 6  # bf16 fp8 nvfp4 x N = 1, 128
    for line in lines:
        assert line.startswith("/opt/ncu --cache-control none --clock-control none -k ")
        assert " -k regex:cuep_(dispatch|combine)_local " in line
        assert f"--launch-skip {npf.DECODE_SKIP} --launch-count 2" in line and "--child decode" in line
    assert npf.main(["--dry-run", "--ops", "--formats", "mxfp4", "--tokens", "4096"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert "--cache-control all" in line and "regex:fused_silu_mxfp4_" in line
    assert line.endswith("--child silu mxfp4 4096")
    assert npf.DECODE_SKIP == 2 * (npf.DECODE_ROUNDS - 4)  # the profiled round is one of the last few


def test_bad_arguments_and_missing_ncu(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        npf.main(["--tokens", "0", "--dry-run"])
    with pytest.raises(SystemExit):
        npf.main(["--formats", "int8"])

    def missing():
        raise FileNotFoundError("ncu (Nsight Compute) not found")

    monkeypatch.setattr(npf, "find_ncu", missing)
    assert npf.main([]) == 2
    assert "not found" in capsys.readouterr().err


def test_units_are_scaled_and_dram_bytes_summarized():
    text = """  cuep_dispatch_local_mxfp4_from_bf16 (132, 1, 1)x(512, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: Command line profiler metrics
    ---------------------------------------------------- ----------- ------------
    Metric Name                                          Metric Unit Metric Value
    ---------------------------------------------------- ----------- ------------
    dram__bytes_read.sum                                       Mbyte        60.25
    dram__bytes_write.sum                                      Gbyte         0.13
    dram__throughput.avg.pct_of_peak_sustained_elapsed             %        71.40
    gpu__time_duration.sum                                   msecond         0.06
    sm__cycles_elapsed.avg                                     cycle      118,000
    smsp__inst_executed.sum                                     inst    1,000,000
"""
    (k,) = npf.parse_report(text)
    assert k.metrics["dram__bytes_read.sum"] == pytest.approx(60.25e6)
    assert k.metrics["dram__bytes_write.sum"] == pytest.approx(0.13e9)
    s = npf.summarize(k, 132)
    assert s["us"] == pytest.approx(60.0) and s["dram_pct"] == pytest.approx(71.4)
    assert s["dram_mb"] == pytest.approx((60.25, 130.0))
    assert "60.2 / 130.0" in npf.format_table([{"case": "mxfp4 N=4096", **s}])


TIMELINE = ROOT / "docs/bench/h200x1/9fae0d8/pm_timeline_mxfp4_4096.csv"


def test_parse_saved_timeline():
    ks = npf.parse_timeline(TIMELINE.read_text())  # (its interval, 2 us, from the export)
    assert [k["kernel"] for k in ks] == ["cuep_dispatch_local_large_mxfp4_from_bf16", "cuep_bench_floor_copy"]
    d, f = ks
    assert len(d["t_us"]) == 34 and len(f["t_us"]) == 27
    assert d["t_us"][:3] == [0.0, 2.0, 4.0] and d["interval_us"] == 2.0
    assert d["us"] == pytest.approx(64.704) and f["us"] == pytest.approx(53.952)
    assert all(len(d[label]) == 34 for label, _ in npf.TIMELINE_SERIES)
    assert d["dram read"][3] == pytest.approx(71.24) and d["dram write"][3] == pytest.approx(24.67)
    assert max(d["l2"]) > 90 and max(f["l2"]) < 90  # the dispatch's store bursts fill L2's throughput
    sd, sf = npf.timeline_summary(d), npf.timeline_summary(f)
    assert sd["dram_mean"] == pytest.approx(sum(d["dram"]) / 34) and 50 < sd["dram_mean"] < sf["dram_mean"]
    assert sd["dram_below_half"] == sum(1 for v in d["dram"] if v < 50)
    text = npf.format_timeline(ks, "mxfp4 N=4096")
    assert text.startswith("mxfp4 N=4096: PM samples") and "64.7 us, 34 samples of 2 us, DRAM 55.3% on average" in text
    assert len(text.splitlines()) == 2 + 34 + 2


def test_timeline_rejects_other_exports_and_bad_arguments(tmp_path, capsys):
    with pytest.raises(ValueError, match="Kernel Name"):
        npf.parse_timeline('"a","b"\n"1","2"\n', 1000)
    with pytest.raises(ValueError, match="dramc__read_throughput"):
        npf.parse_timeline('"ID","Kernel Name"\n"0","k"\n', 1000)
    for argv in (["--timeline", "--ops"], ["--interval-ns", "10", "--dry-run"]):
        with pytest.raises(SystemExit):
            npf.main(argv)
    assert npf.main(["--dry-run", "--timeline", "--formats", "mxfp4", "--tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert "--section PmSampling --pm-sampling-interval 1000" in out and "--child floor mxfp4 4096" in out

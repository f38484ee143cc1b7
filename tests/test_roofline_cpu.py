"""scripts/silu_roofline.py runs on the CPU and finds a sane steady-state loop in every fused_silu / quantize kernel."""
from __future__ import annotations

import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))

import silu_roofline  # noqa: E402


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"),
                    reason="nvcc not found")
def test_roofline_numbers_are_sane(tmp_path):
    if silu_roofline.find_tool("nvdisasm") is None:
        pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    gpu = silu_roofline.GPUS["h200"]
    rows = {}
    for f in ("silu.cu", "quantize.cu"):
        for name, lines in silu_roofline.disassemble(silu_roofline.compile_cubin(f, str(tmp_path))).items():
            r = silu_roofline.analyse(name, lines, gpu)
            if r is not None:
                rows[name] = r
    for fmt in ("bf16", "fp8", "nvfp4", "mxfp4"):
        r = rows[f"fused_silu_{fmt}_bf16"]
        assert r["elems_per_lane"] == 32, r                 # a 4 KiB stage: 1024 values, 32 per lane per span
        assert r["per_elem"]["mufu"] >= 1.0, r              # one reciprocal per value (silu)
        assert 16 < r["instr_per_elem"] < 80, r             # silu alone is about 16 FP32 operations per value
    for fmt in ("fp8", "nvfp4", "mxfp4"):
        r = rows[f"quantize_{fmt}_bf16"]
        assert r["elems_per_lane"] == 16 and 3 < r["instr_per_elem"] < 40, r
        assert r["gbps"]["issue"] > 0 and r["binding"] in ("issue", "alu", "mufu", "copy")

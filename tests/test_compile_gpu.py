"""cuep.compile_kernels on a GPU: the units it compiles are the modules the calls then use (no second compile)."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def test_compile_kernels_fills_the_modules_calls_use():
    import cupy

    import cuep
    from cuep import _kernels

    dev = cupy.cuda.Device().id
    times = cuep.compile_kernels("fp8", ops=False)
    assert set(times) == {"dispatch.cu[fp8]", "combine.cu"} and all(t >= 0 for t in times.values())
    mod = _kernels._modules[("dispatch.cu", "fp8", dev, ())]
    assert _kernels.module("dispatch.cu", part="fp8") is mod
    fn = _kernels.function("dispatch.cu", "cuep_dispatch_local_fp8_from_bf16")
    assert fn.kernel.ptr  # a kernel of the compiled part
    with pytest.raises(Exception):  # a part holds its format's kernels only
        mod.get_function("cuep_dispatch_local_bf16_from_bf16")


def test_cli_compile_builds_every_unit():
    res = subprocess.run([sys.executable, "-m", "cuep", "--compile"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    for unit in ("dispatch.cu[bf16]", "dispatch.cu[mxfp4]", "combine.cu", "silu.cu"):
        assert unit in res.stdout, res.stdout
    assert "kernel units ready" in res.stdout

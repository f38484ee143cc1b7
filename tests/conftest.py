"""Shared fixtures: GPU detection that skips cleanly, fresh random generators."""
from __future__ import annotations

import numpy as np
import pytest


def _n_gpus() -> int:
    try:
        import cupy

        if not cupy.cuda.is_available():
            return 0
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


N_GPUS = _n_gpus()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (none found)")
    skip_multi = pytest.mark.skip(reason=f"needs >= 2 NVIDIA GPUs ({N_GPUS} found)")
    for item in items:
        if "multigpu" in item.keywords and N_GPUS < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and N_GPUS < 1:
            item.add_marker(skip_gpu)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A fresh generator per test, seeded from the test's name so a failure reproduces."""
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))

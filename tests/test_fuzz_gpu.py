"""Fuzz of the public API on GPU 0 (issue 22): at least 1,000 seeded malformed calls (tests/fuzz_calls.py) against
dispatch / combine and their async halves, cuep.ops, cuep.moe, Buffer and EPConfig construction. Each call works as
documented or raises TypeError / ValueError / RuntimeError / cuep.EPError naming the argument; nothing crashes or
hangs, and a correct round on the same buffers is exact afterwards."""
from __future__ import annotations

import numpy as np
import pytest

import fuzz_calls
from ep_check import run_round

SEED = 2222
N_CASES = 1200


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_fuzz_public_api():
    cases = fuzz_calls.generate(SEED, N_CASES)
    f = fuzz_calls.Fuzz(SEED)
    for case in cases:
        f.run(case)
    print(f"fuzz seed={SEED}: {len(cases)} cases, {f.calls} calls; per category {fuzz_calls.counts(cases)}; "
          f"outcomes {f.outcomes}")
    assert f.calls >= 1000
    rng = np.random.default_rng(SEED)
    for s in f.sides.values():  # nothing was corrupted: correct rounds on the same buffers are exact
        s.buf.check()
        assert s.buf._rounds["pending"] is None
        run_round(s.buf, s.cfg, rng, s.n, bare=s.bare)
        run_round(s.buf, s.cfg, rng, s.n, weights_at="combine", residual=True, async_halves=True, bare=s.bare)
        run_round(s.buf, s.cfg, rng, s.n, weights_at=None, bare=s.bare)
    f.close()

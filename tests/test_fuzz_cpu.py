"""The fuzz generator (tests/fuzz_calls.py) without a GPU: deterministic, >= 1,000 cases over every category and
catalogue entry; its construction cases (EPConfig, Buffer arguments checked before any device is touched) run
here for real; and the argument checks added with it that need no GPU."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import cuep
import fuzz_calls as F
from cuep import ep, moe, ops


def test_generator_is_deterministic_and_covers_every_category():
    a, b, c = F.generate(5, 1200), F.generate(5, 1200), F.generate(6, 1200)
    assert a == b and a != c
    assert len(a) >= 1000
    counts = F.counts(a)
    assert set(counts) == set(F.CATEGORIES), counts
    entries = {(x["category"], x["target"], x["arg"]) for x in a}
    assert entries == {(cat, t, arg) for cat in F.CATEGORIES for t, arg in F.CATALOGUE[cat]}
    assert {x["buf"] for x in a} == {"sim2", "gpu1"}


def test_names_matches_whole_words():
    assert F.names("x[rank 0] must be 2-D", "x")
    assert F.names("h.shape[1] // 2 (I)=260 must be", "h")
    assert not F.names("more than cfg.max_tokens_per_rank", "x")
    assert F.names("cfg.n_ranks=2 must equal", "n_ranks")


def _group(n, closed):
    g = cuep.Group(devices=[0] * n, ranks=list(range(n)), n_ranks=n)  # never touches a device before the checks
    if closed:
        g.close()
    return g


@pytest.mark.parametrize("case", [c for c in F.generate(2222, 1200) if c["category"] == "construct"
                                  and not (c["target"] == "buffer" and c["arg"] == "num_sms"
                                           and F.BAD_VALUES[("buffer", "num_sms")][c["variant"] % 5] in (-1, 10**6))],
                         ids=lambda c: f"{c['i']}-{c['target']}-{c['arg']}")
def test_construct_cases_raise_naming_the_argument(case):
    thunk, types, token = F.construct_call(case, _group)
    with pytest.raises(types) as e:
        thunk()
    assert F.names(str(e.value), token), str(e.value)


@pytest.mark.parametrize("key", [k for k in F.BAD_VALUES if k[0] == "epconfig"])
def test_every_bad_epconfig_value_raises(key):
    for v in F.BAD_VALUES[key]:
        with pytest.raises((ValueError, TypeError)) as e:
            cuep.EPConfig(**{**F.STD, key[1]: v})
        assert F.names(str(e.value), key[1]), str(e.value)


@pytest.mark.parametrize("arg", ["intermediate", "seed", "devices"])
def test_init_weights_bad_values(arg):
    cfg = cuep.EPConfig(**F.STD)
    for v in F.BAD_VALUES[("init_weights", arg)]:
        kw = {"intermediate": 64, "seed": 0, "devices": None, arg: v}
        with pytest.raises((TypeError, ValueError)) as e:
            moe.init_weights(cfg, kw["intermediate"], kw["seed"], kw["devices"])
        assert F.names(str(e.value), arg), str(e.value)


def test_ops_global_scale_must_be_a_number():
    for g in ("1", None, [1.0], True, 0.0, float("nan")):
        with pytest.raises(ValueError, match="global_scale"):
            ops._check_global_scale(g)
    assert ops._check_global_scale(np.float32(0.5)) == np.float32(0.5)


@pytest.mark.parametrize("call, exc, match", [
    (lambda x, r: moe.route([[1.0] * 4], r, 2), TypeError, r"^x must be a NumPy or CuPy array, got list"),
    (lambda x, r: moe.route(x, None, 2), TypeError, r"^router must be a NumPy or CuPy array"),
    (lambda x, r: moe.route(x[0], r, 2), ValueError, r"^x must be 2-D"),
    (lambda x, r: moe.route(x.astype(np.float16), r, 2), TypeError, r"^x has dtype float16"),
    (lambda x, r: moe.route(x, r.astype(np.float64), 2), TypeError, r"^router has dtype float64"),
    (lambda x, r: moe.route(x, r[:3], 2), ValueError, r"^router has shape \(3, 8\)"),
    (lambda x, r: moe.route(x, r, 0), ValueError, r"^top_k=0 must be an int in \[1, n_experts=8\]"),
    (lambda x, r: moe.route(x, r, 2.0), ValueError, r"^top_k=2\.0"),
    (lambda x, r: moe.route(x, r, True), ValueError, r"^top_k=True"),
], ids=["x-list", "router-none", "x-1d", "x-f16", "router-f64", "router-shape", "top_k-0", "top_k-float",
        "top_k-bool"])
def test_route_argument_checks(call, exc, match):
    x = np.ones((5, 4), np.float32)
    r = np.ones((4, 8), np.float32)
    with pytest.raises(exc, match=match):
        call(x, r)


def test_pending_half_blocks_other_calls():
    """The order rule's message without a GPU: a pending half is named with the call that finishes it."""
    buf = SimpleNamespace(_rounds={"dispatches": 3, "pending": ("dispatch", 3)})
    with pytest.raises(RuntimeError, match=r"^cuep\.dispatch: a dispatch_async .*dispatch_wait\(pending\).* still "
                                           r"pending.*buf\.reset\(\)"):
        ep._check_nothing_pending(buf, "cuep.dispatch")
    buf._rounds["pending"] = ("combine", 3, [0], [0])
    with pytest.raises(RuntimeError, match=r"^cuep\.combine: a combine_async .*combine_wait"):
        ep._check_nothing_pending(buf, "cuep.combine")
    buf._rounds["pending"] = None
    ep._check_nothing_pending(buf, "cuep.dispatch")

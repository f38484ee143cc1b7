"""The soak's plan (tests/soak_rounds.py) without a GPU: deterministic for a seed, every kind of round covered, the
routings do what their names say, and every planned round runs through cuep.reference."""
from __future__ import annotations

import numpy as np
import pytest

import soak_rounds as S
from cuep import reference as ref


def test_plan_is_deterministic_for_a_seed():
    a, b, c = S.plan(7, 500), S.plan(7, 500), S.plan(8, 500)
    assert a == b
    assert a[1] != c[1]


@pytest.mark.parametrize("rounds, n_configs", [(10000, None), (300, 16)], ids=["bench-10000", "test-300"])
def test_plan_covers_every_kind(rounds, n_configs):
    configs, plan = S.plan(22 if rounds == 300 else 1, rounds, n_configs)
    if n_configs:
        assert len(configs) == n_configs
    c = S.counts(plan)
    assert sum(c["group"].values()) == rounds
    for kind, values in (("group", S.GROUPS), ("format", S.FORMATS), ("options", S.OPTIONS), ("small", S.SMALL),
                         ("routing", S.ROUTINGS), ("weights_at", S.WEIGHTS_AT), ("dtype", ("bf16", "f32"))):
        assert set(c[kind]) == set(values), (kind, c[kind])
    for kind in ("residual", "async_dispatch", "async_combine", "bare", "a_rank_with_0", "a_rank_with_T",
                 "nvfp4_global_scale_1"):
        assert set(c[kind]) == {"True", "False"}, (kind, c[kind])


def test_rounds_are_well_formed():
    configs, plan = S.plan(3, 2000)
    cfgs = {c.key: c.ep_config() for c in configs}
    for r in plan:
        cfg = cfgs[r.config]
        assert len(r.n_tokens) == cfg.n_ranks
        assert all(0 <= n <= cfg.max_tokens_per_rank for n in r.n_tokens)
        if cfg.skip_a2a:
            assert len(set(r.n_tokens)) == 1
        if r.routing == "empty_src":
            assert 0 in r.n_tokens
        if r.routing == "empty_dst":
            assert 1 <= len(r.excluded) < cfg.n_ranks
        assert not (r.residual and r.weights_at == "none")
        assert r.global_scale == 1.0 or cfg.dispatch_format == "nvfp4"
        assert not r.bare or cfg.n_ranks == 1


@pytest.mark.parametrize("routing", S.ROUTINGS)
def test_routing_ids(routing):
    cfg = S.Config("sim4", "bf16", "plain", "mixed").ep_config()
    rng = np.random.default_rng(5)
    ids = S.routing_ids(rng, 200, cfg, routing, excluded=(1, 3))
    assert ids.dtype == np.int32 and ids.shape == (200, cfg.top_k)
    assert ((ids >= 0) & (ids < cfg.n_experts)).all()
    assert all(len(set(row)) == cfg.top_k for row in ids.tolist())
    owner = ids // cfg.n_local_experts
    if routing == "empty_dst":
        assert not np.isin(owner, [1, 3]).any()
    elif routing == "hot_expert":
        assert np.bincount(ids.ravel(), minlength=cfg.n_experts).max() == 200  # one expert in every row
    elif routing == "skewed":
        hist = np.bincount(ids.ravel(), minlength=cfg.n_experts)
        assert hist.max() > 2 * hist.mean()


def test_warmup_touches_every_mode():
    configs = S.select_configs(22, 16)
    w = S.warmup_rounds(configs)
    assert len(w) == 3 * len(configs)
    for c in configs:
        mine = [r for r in w if r.config == c.key]
        assert {r.weights_at for r in mine} == set(S.WEIGHTS_AT) and {r.dtype for r in mine} == {"bf16", "f32"}
        assert any(r.async_dispatch and r.async_combine for r in mine)


def test_planned_rounds_run_through_the_reference():
    """The host half of a round (inputs, reference dispatch and combine) for the first rounds of the test's plan."""
    configs, plan = S.plan(22, 60, 16)
    cfgs = {c.key: c.ep_config() for c in configs}
    for r in plan:
        cfg = cfgs[r.config]
        xs, ids, ws, rng = S.make_inputs(r, cfg)
        assert [x.shape[0] for x in xs] == list(r.n_tokens)
        want = ref.dispatch([np.asarray(x) for x in xs], ids, cfg, global_scale=r.global_scale)
        eo = [rng.standard_normal((d.n_rows, cfg.hidden)).astype(np.float32) for d in want]
        out = ref.combine(eo, want, None if r.weights_at == "none" else ws, cfg, num_tokens=list(r.n_tokens))
        assert len(out) == cfg.n_ranks

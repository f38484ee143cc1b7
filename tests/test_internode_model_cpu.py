"""``cuep.bench.internode_model`` (no GPU): expectations against enumeration and Monte Carlo, byte formulas on
hand-computed cases, a simulation of the two-hop protocol rank by rank, and the tables."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import cuep
from cuep.bench import internode_model as im

ISSUE = dict(hidden=7168, top_k=8, n_experts=256, n_gpus_per_node=8)


def exact_by_enumeration(M: int, G: int, E: int, K: int, routing: str) -> tuple[float, float, float, float]:
    """(nodes, remote nodes, ranks, remote ranks) per token, averaging over every equally likely draw; the source
    sits on node 0."""
    n_pool, per_node, per_rank = M if routing == "uniform" else im.routing_nodes(routing, M), E // M, E // (M * G)
    acc, count = np.zeros(4), 0
    for nodes in itertools.combinations(range(M), n_pool):
        pool = [n * per_node + j for n in nodes for j in range(per_node)]
        for experts in itertools.combinations(pool, K):
            hit_nodes = {e // per_node for e in experts}
            hit_ranks = {e // per_rank for e in experts}
            acc += (len(hit_nodes), len(hit_nodes - {0}), len(hit_ranks), len({r for r in hit_ranks if r >= G}))
            count += 1
    return tuple(acc / count)


@pytest.mark.parametrize("M, G, E, K, routing", [
    (2, 1, 2, 1, "uniform"), (2, 2, 4, 2, "uniform"), (4, 2, 16, 3, "uniform"), (4, 2, 16, 3, "limited:2"),
    (3, 2, 12, 4, "limited:2"), (4, 1, 8, 2, "limited:4"), (5, 1, 10, 2, "limited:1"), (5, 1, 20, 3, "limited:3")])
def test_expectations_equal_enumeration(M, G, E, K, routing):
    want = exact_by_enumeration(M, G, E, K, routing)
    args = (M, G, E, K, routing)
    got = (im.expected_nodes_per_token(*args), im.expected_nodes_per_token(*args, remote=True),
           im.expected_ranks_per_token(*args), im.expected_ranks_per_token(*args, remote=True))
    np.testing.assert_allclose(got, want, rtol=1e-12)


def monte_carlo(M, G, E, K, routing, n=40000, seed=0):
    ids = im.sample_routing(np.random.default_rng(seed), n, M, G, E, K, routing)
    node_hit = np.zeros((n, M), bool)
    node_hit[np.arange(n)[:, None], ids // (E // M)] = True
    rank_hit = np.zeros((n, M * G), bool)
    rank_hit[np.arange(n)[:, None], ids // (E // (M * G))] = True
    return ids, node_hit, rank_hit


@pytest.mark.parametrize("M, routing", [(2, "uniform"), (4, "uniform"), (8, "uniform"), (8, "limited:4"),
                                        (4, "limited:2")])
def test_expectations_match_monte_carlo_at_issue_shape(M, routing):
    G, E, K = 8, 256, 8
    ids, node_hit, rank_hit = monte_carlo(M, G, E, K, routing)
    assert all(len(set(row)) == K for row in ids[:500])           # K distinct experts per token
    args = (M, G, E, K, routing)
    # source on node 0: the routing is node-symmetric
    assert node_hit.sum(1).mean() == pytest.approx(im.expected_nodes_per_token(*args), abs=0.02)
    assert node_hit[:, 1:].sum(1).mean() == pytest.approx(im.expected_nodes_per_token(*args, remote=True), abs=0.02)
    assert rank_hit.sum(1).mean() == pytest.approx(im.expected_ranks_per_token(*args), abs=0.03)
    assert rank_hit[:, G:].sum(1).mean() == pytest.approx(im.expected_ranks_per_token(*args, remote=True), abs=0.03)


@pytest.mark.parametrize("M, G, E", [(8, 8, 256), (16, 1, 64), (5, 2, 40)])
def test_limited_4_never_uses_more_than_4_nodes(M, G, E):
    _, node_hit, _ = monte_carlo(M, G, E, 8, "limited:4", n=20000, seed=1)
    assert node_hit.sum(1).max() <= 4
    assert im.expected_nodes_per_token(M, G, E, 8, "limited:4") <= 4
    assert im.expected_nodes_per_token(M, G, E, 8, "limited:4") < im.expected_nodes_per_token(M, G, E, 8)


def test_sample_routing_is_uniform_over_experts():
    ids = im.sample_routing(np.random.default_rng(2), 20000, 8, 8, 256, 8, "limited:4")
    counts = np.bincount(ids.ravel(), minlength=256)
    assert counts.min() > 0.8 * counts.mean() and counts.max() < 1.2 * counts.mean()


# ---- bytes on hand-computed cases ------------------------------------------------------------------------------
def test_bytes_two_nodes_one_gpu_k1():
    # E = 2 (expert 0 on node 0, expert 1 on node 1), K = 1, H = 8: row bf16 16 B, header 8 B; a token goes remote
    # with probability 1/2.
    s = im.Shape(hidden=8, top_k=1, n_experts=2, n_gpus_per_node=1, n_nodes=2)
    b = lambda **kw: im.network_bytes_per_rank(s, 10, "bf16", "uniform", **kw)
    assert b(dedup=True) == pytest.approx(10 * (0.5 * 16 + 1 * 8))        # header to the other node always
    assert b(dedup=True, header_every_node=False) == pytest.approx(10 * 0.5 * 24)
    assert b(dedup=False) == pytest.approx(10 * 0.5 * 24)
    assert b(dedup=True, phase="combine") == pytest.approx(10 * 0.5 * 16)
    assert b(dedup=False, phase="combine") == pytest.approx(10 * 0.5 * 16)
    assert b(dedup=True, phase="combine", combine_dtype="float32") == pytest.approx(10 * 0.5 * 32)


def test_bytes_two_nodes_two_gpus_k2_fp8():
    # E = 4: node 0 holds experts 0, 1 (ranks 0, 1), node 1 experts 2, 3 (ranks 2, 3); K = 2 of 4: 6 equally likely
    # pairs. From node 0: the other node is hit unless the pair is {0, 1} (5/6); remote ranks: 2 for {2, 3}, 1 for
    # the 4 mixed pairs, so 1 on average. H = 128 fp8: row 128 + 4 = 132 B, header 16 B.
    s = im.Shape(hidden=128, top_k=2, n_experts=4, n_gpus_per_node=2, n_nodes=2)
    assert im.row_bytes("fp8", 128) == 132 and im.header_bytes(2) == 16
    assert im.expected_nodes_per_token(2, 2, 4, 2) == pytest.approx(5 / 3)
    assert im.expected_ranks_per_token(2, 2, 4, 2) == pytest.approx(2.0)
    assert im.network_bytes_per_rank(s, 6, "fp8", dedup=True) == pytest.approx(6 * (5 / 6 * 132 + 16))
    assert im.network_bytes_per_rank(s, 6, "fp8", dedup=False) == pytest.approx(6 * 1 * 148)
    assert im.network_bytes_per_rank(s, 6, "fp8", dedup=True, phase="combine") == pytest.approx(6 * 5 / 6 * 256)
    assert im.network_bytes_per_rank(s, 6, "fp8", dedup=False, phase="combine") == pytest.approx(6 * 256)
    # DeepEP's count: (token, node) pairs, own node included; remote all-to-all: (token, remote rank) pairs
    assert im.deepep_counted_bytes(s, 6, "fp8") == pytest.approx(6 * 5 / 3 * 132)
    assert im.remote_a2a_bytes(s, 6, "fp8") == pytest.approx(6 * 132)


def test_formats_row_bytes_at_issue_shape():
    assert im.row_bytes("bf16", 7168) == 14336
    assert im.row_bytes("fp8", 7168) == 7168 + 4 * 56
    assert im.row_bytes("nvfp4", 7168) == 3584 + 448
    assert im.row_bytes("mxfp4", 7168) == 3584 + 224


def test_zero_tokens_send_nothing():
    s = im.Shape(hidden=8, top_k=1, n_experts=2, n_gpus_per_node=1, n_nodes=2)
    assert im.network_bytes_per_rank(s, 0) == 0 and im.nvlink_bytes_per_rank(s, 0) == 0


def test_one_node_sends_nothing_over_the_network():
    s = im.Shape(n_nodes=1, **ISSUE)
    for dedup in (True, False):
        assert im.network_bytes_per_rank(s, 4096, "fp8", dedup=dedup) == 0


# ---- dedup never sends more ------------------------------------------------------------------------------------
GRID = [(M, G, E, K) for M in (2, 3, 4, 8) for G in (1, 2, 8) for E in (M * G * 4, M * G * 8) for K in (1, 2, 8)
        if K <= E]


@pytest.mark.parametrize("M, G, E, K", GRID)
@pytest.mark.parametrize("phase", im.PHASES)
def test_dedup_never_more_bytes_when_header_goes_where_the_token_goes(M, G, E, K, phase):
    s = im.Shape(hidden=256, top_k=K, n_experts=E, n_gpus_per_node=G, n_nodes=M)
    for routing in ("uniform", "limited:1", "limited:4"):
        if K > im.routing_nodes(routing, M) * E // M:
            continue
        d = im.network_bytes_per_rank(s, 100, "fp8", routing, True, phase, header_every_node=False)
        n = im.network_bytes_per_rank(s, 100, "fp8", routing, False, phase)
        assert d <= n * (1 + 1e-12)


@pytest.mark.parametrize("M", [2, 4, 8, 16])
@pytest.mark.parametrize("fmt", list(cuep.FORMATS))
@pytest.mark.parametrize("routing", ["uniform", "limited:4"])
@pytest.mark.parametrize("phase", im.PHASES)
def test_dedup_never_more_bytes_at_issue_shapes(M, fmt, routing, phase):
    s = im.Shape(n_nodes=M, **ISSUE)
    for N in (1, 128, 4096):
        assert (im.network_bytes_per_rank(s, N, fmt, routing, True, phase)
                <= im.network_bytes_per_rank(s, N, fmt, routing, False, phase))


def test_header_to_every_node_costs_more_with_one_expert_per_token():
    # The one case it loses: K = 1 and 2 nodes, the header travels even when the token stays home.
    s = im.Shape(hidden=8, top_k=1, n_experts=2, n_gpus_per_node=1, n_nodes=2)
    assert im.network_bytes_per_rank(s, 1, dedup=True) > im.network_bytes_per_rank(s, 1, dedup=False)


# ---- a rank-by-rank simulation of the protocol -----------------------------------------------------------------
def simulate(M, G, E, K, routing, N=3000, seed=3):
    """Rows per rank (mean over ranks): network out with and without dedup, NVLink out with and without dedup,
    following every token of every rank through the protocol."""
    R, per_rank = M * G, E // (M * G)
    rng = np.random.default_rng(seed)
    net = {True: np.zeros(R), False: np.zeros(R)}
    nvl = {True: np.zeros(R), False: np.zeros(R)}
    for src in range(R):
        node, idx = divmod(src, G)
        # a node-symmetric draw relabels nodes so that node 0 of the draw is the source's node
        ids = im.sample_routing(rng, N, M, G, E, K, routing)
        ranks = (ids // per_rank + node * G) % R
        hit = np.zeros((N, R), bool)
        hit[np.arange(N)[:, None], ranks] = True
        for m in range(M):
            on_m = hit[:, m * G:(m + 1) * G]                               # [N, G]
            if m == node:
                others = on_m.sum() - on_m[:, idx].sum()                   # own node: NVLink, either way
                nvl[True][src] += others
                nvl[False][src] += others
                continue
            net[False][src] += on_m.sum()                                  # one row per remote rank
            bound = on_m.any(1)
            net[True][src] += bound.sum()                                  # one row per remote node
            fwd = m * G + idx                                              # the forwarder hands on over NVLink
            nvl[True][fwd] += (on_m.sum(1) - on_m[:, idx]).sum()
    return {k: (net[k].mean(), nvl[k].mean()) for k in (True, False)}


@pytest.mark.parametrize("M, G, E, K, routing", [(2, 8, 256, 8, "uniform"), (4, 4, 64, 6, "uniform"),
                                                  (8, 2, 64, 8, "limited:4"), (3, 2, 24, 3, "limited:2")])
def test_model_matches_protocol_simulation(M, G, E, K, routing):
    N = 3000
    sim = simulate(M, G, E, K, routing, N)
    s = im.Shape(hidden=8, top_k=K, n_experts=E, n_gpus_per_node=G, n_nodes=M)    # bf16 row 16 B
    for dedup in (True, False):
        net = im.network_bytes_per_rank(s, N, "bf16", routing, dedup, "combine") / 16
        nvl = im.nvlink_bytes_per_rank(s, N, "bf16", routing, dedup) / 16
        assert sim[dedup][0] == pytest.approx(net, rel=0.02)
        assert sim[dedup][1] == pytest.approx(nvl, rel=0.02)


# ---- time, bandwidth, tables -----------------------------------------------------------------------------------
def test_round_time():
    assert im.round_time_us(50e3) == pytest.approx(1.0)
    assert im.round_time_us(1e6, nic_GBps=25.0) == pytest.approx(40.0)
    with pytest.raises(ValueError, match="nic_GBps"):
        im.round_time_us(1.0, 0.0)


def test_crossover():
    s = im.Shape(n_nodes=2, **ISSUE)
    saved = (im.network_bytes_per_rank(s, 1, "fp8", dedup=False) - im.network_bytes_per_rank(s, 1, "fp8"))
    assert im.dedup_crossover_tokens(s, "fp8", extra_hop_us=5.0) == pytest.approx(5.0 * 50e3 / saved)
    assert im.dedup_crossover_tokens(s, "fp8", extra_hop_us=0.0) == 0.0
    one = im.Shape(hidden=8, top_k=1, n_experts=2, n_gpus_per_node=1, n_nodes=2)
    assert im.dedup_crossover_tokens(one) == math.inf


def test_epconfig_is_a_shape():
    cfg = cuep.EPConfig(hidden=7168, top_k=8, n_experts=256, max_tokens_per_rank=4096, n_gpus_per_node=8,
                        n_nodes=4, dispatch_format="fp8")
    s = im.Shape(n_nodes=4, **ISSUE)
    for phase in im.PHASES:
        assert (im.network_bytes_per_rank(cfg, 4096, "fp8", phase=phase)
                == im.network_bytes_per_rank(s, 4096, "fp8", phase=phase))


def test_table_rows_and_bandwidth_definitions():
    rows = im.table()
    assert len(rows) == 3 * 2 * 3 * 2                     # nodes x routings x (bf16, fp8, combine) x dedup
    by = {(r["nodes"], r["routing"], r["phase"], r["format"], r["dedup"]): r for r in rows}
    for r in rows:
        assert r["time_us"] == pytest.approx(r["network_MB"] * 1e6 / 50e3)
        assert r["remote_nodes_per_token"] <= r["remote_ranks_per_token"]
        if r["dedup"]:
            twin = by[(r["nodes"], r["routing"], r["phase"], r["format"], False)]
            assert r["network_MB"] <= twin["network_MB"] and r["deepep_GBps"] >= twin["deepep_GBps"]
            assert r["a2a_GBps"] > 50.0                    # dedup delivers more logical bytes than the wire carries
        if r["nodes"] <= 4:                                # limited:4 with at most 4 nodes is uniform
            u = by[(r["nodes"], "uniform", r["phase"], r["format"], r["dedup"])]
            assert r["network_MB"] == pytest.approx(u["network_MB"])
    # dedup in DeepEP's count: the NIC's 50 GB/s x M / (M - 1), less the header's share
    for M in (2, 4, 8):
        c = by[(M, "uniform", "combine", "bf16", True)]
        assert c["deepep_GBps"] == pytest.approx(50.0 * M / (M - 1))
        d = by[(M, "limited:4", "dispatch", "fp8", True)]
        assert 0.98 * 50.0 * M / (M - 1) < d["deepep_GBps"] < 50.0 * M / (M - 1)


def test_key_figures():
    """The numbers quoted in docs/internode.md and BENCHMARKS.md."""
    by = {(r["nodes"], r["routing"], r["phase"], r["format"], r["dedup"]): r for r in im.table()}
    r = by[(2, "uniform", "dispatch", "fp8", True)]
    assert (round(r["network_MB"], 1), round(r["time_us"]), round(r["deepep_GBps"], 1)) == (30.4, 609, 99.1)
    r = by[(8, "limited:4", "dispatch", "fp8", True)]
    assert (round(r["network_MB"], 1), round(r["time_us"]), round(r["deepep_GBps"], 1)) == (98.0, 1960, 56.1)
    r = by[(8, "limited:4", "dispatch", "fp8", False)]
    assert (round(r["network_MB"], 1), round(r["time_us"])) == (196.7, 3933)


@pytest.mark.parametrize("kw, match", [
    (dict(routing="limited:0"), "routing"), (dict(routing="top4"), "routing"), (dict(phase="send"), "phase"),
    (dict(fmt="fp16"), "fmt"), (dict(combine_dtype="float16", phase="combine"), "combine_dtype"),
    (dict(n_tokens=-1), "n_tokens")])
def test_errors_name_the_argument(kw, match):
    args = dict(shape=im.Shape(n_nodes=2, **ISSUE), n_tokens=16)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        im.network_bytes_per_rank(**args)


def test_group_errors():
    with pytest.raises(ValueError, match="n_experts"):
        im.expected_nodes_per_token(3, 8, 256, 8)
    with pytest.raises(ValueError, match="top_k"):
        im.expected_nodes_per_token(8, 1, 16, 4, "limited:1")   # 2 experts per node, 1 node allowed
    with pytest.raises(ValueError, match="gpus_per_node"):
        im.expected_ranks_per_token(2, 0, 16, 2)


def test_main_prints_markdown(capsys):
    im.main([])
    out = capsys.readouterr().out
    assert "| 2 x 8 | uniform, limited:4 | fp8 | 1.00 / 3.26 | 30.4 / 99.6 | 609 / 1992 | 99.1 / 30.3 |" in out
    assert "| 8 x 8 | limited:4 | fp8 | 3.18 / 6.44 | 98.0 / 196.7 | 1960 / 3933 | 56.1 / 27.9 |" in out
    assert "| 2 x 8 | uniform, limited:4 | 172.8 | 5.68 | 1080 / 485 | 609 | 55.9 / 99.1 |" in out
    assert "Small rounds, N = 128" in out

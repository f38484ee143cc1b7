"""Seeded soak rounds: many dispatch + combine rounds in a row on GPU 0, each checked against cuep.reference.

Shared by tests/test_soak_gpu.py (a few hundred rounds, always run on a GPU), benchmarks/soak.py (10,000 rounds)
and tests/test_soak_cpu.py (the plan is deterministic and covers every kind of round).

The plan (:func:`plan`) is pure NumPy: from a seed it picks the configurations (group x format x options x
small-round mode; one :class:`cuep.Buffer` each, created once and reused) and, per round, the configuration, the
tokens per rank (0 .. T, both ends often), the routing, where the weights go, a residual, the async halves, the input
dtype, nvfp4's global scale and the seed of the round's data. :func:`run` executes it on GPU 0: a warm-up (every
buffer created and used in every mode once), the rounds (dispatch bit-exact, unreduced combine exact, weighted
combine within ep_check.run_round's tolerance), the GPU memory before and after, and per-round times.
"""
from __future__ import annotations

import gc
import itertools
import math
import time
from dataclasses import asdict, dataclass

import numpy as np

import cuep
from ep_check import BF16, check_dispatch, poison_outputs, random_tokens, to_devices
from cuep import reference as ref

#: simulated ranks on GPU 0 (the phase-by-phase path) and one real rank (the fused single launch)
GROUPS = {"sim4": [0, 0, 0, 0], "sim2": [0, 0], "gpu1": [0]}
#: per group: (hidden, max_tokens_per_rank, n_experts, top_k): small, so one round costs a few ms
SHAPES = {"sim4": (256, 32, 16, 4), "sim2": (512, 64, 16, 8), "gpu1": (256, 64, 32, 8)}
FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")
OPTIONS = {
    "plain": {},
    "shared": {"fused_shared_expert": True},
    "skip_a2a": {"skip_a2a": True},
    "shared_skip": {"fused_shared_expert": True, "skip_a2a": True},
    "shared_skip_ar2": {"fused_shared_expert": True, "skip_a2a": True, "allreduce_world_size": 2},
    "f32_combine": {"combine_dtype": "float32"},
}
#: small_batch_tokens as a fraction of T: every round staged, every round direct, or ranks of both kinds
SMALL = {"staged": 1.0, "direct": 0.0, "mixed": 0.5}
ROUTINGS = ("uniform", "skewed", "hot_expert", "empty_src", "empty_dst")
WEIGHTS_AT = ("dispatch", "combine", "none")


@dataclass(frozen=True)
class Config:
    group: str
    fmt: str
    options: str
    small: str

    @property
    def key(self) -> str:
        return f"{self.group}/{self.fmt}/{self.options}/{self.small}"

    def ep_config(self) -> cuep.EPConfig:
        H, T, E, K = SHAPES[self.group]
        return cuep.EPConfig(hidden=H, top_k=K, n_experts=E, max_tokens_per_rank=T,
                             n_gpus_per_node=len(GROUPS[self.group]), dispatch_format=self.fmt,
                             small_batch_tokens=int(SMALL[self.small] * T), **OPTIONS[self.options])


@dataclass(frozen=True)
class Round:
    """One round: everything but the data, which comes from ``np.random.default_rng(data_seed)``."""

    config: str
    n_tokens: tuple
    routing: str
    excluded: tuple          # empty_dst: ranks whose experts no token picks
    weights_at: str
    residual: bool
    async_dispatch: bool
    async_combine: bool
    dtype: str               # "bf16" | "f32" (dispatch input)
    global_scale: float
    bare: bool               # one rank: bare arrays instead of one-entry lists
    data_seed: int


def all_configs() -> list[Config]:
    out = []
    for g, f, o, s in itertools.product(GROUPS, FORMATS, OPTIONS, SMALL):
        if o == "shared_skip_ar2" and len(GROUPS[g]) < 2:
            continue
        out.append(Config(g, f, o, s))
    return out


def select_configs(seed: int, n: int | None) -> list[Config]:
    """``n`` configurations (all when None) covering every group, format, option set and small-round mode."""
    configs = all_configs()
    if n is None or n >= len(configs):
        return configs
    rng = np.random.default_rng([seed, 1])
    order = [configs[i] for i in rng.permutation(len(configs))]
    chosen, seen = [], set()
    for c in order:  # first those that bring a value not yet covered
        new = {("group", c.group), ("fmt", c.fmt), ("options", c.options), ("small", c.small)} - seen
        if new:
            chosen.append(c)
            seen |= new
    chosen += [c for c in order if c not in chosen][: max(0, n - len(chosen))]
    return chosen


def _n_tokens(rng, T: int) -> int:
    u = rng.random()
    return 0 if u < 0.12 else T if u < 0.27 else int(rng.integers(1, T))


def plan(seed: int, rounds: int, n_configs: int | None = None) -> tuple[list[Config], list[Round]]:
    """The configurations and the rounds for ``seed`` (deterministic; no GPU needed)."""
    configs = select_configs(seed, n_configs)
    rng = np.random.default_rng([seed, 2])
    out = []
    for i in range(rounds):
        c = configs[int(rng.integers(len(configs)))]
        cfg = c.ep_config()
        R, T, L = cfg.n_ranks, cfg.max_tokens_per_rank, cfg.n_local_experts
        most = min(R - 1, (cfg.n_experts - cfg.top_k) // L)  # ranks whose experts can all be left out
        routings = ROUTINGS if most >= 1 else tuple(r for r in ROUTINGS if r != "empty_dst")
        routing = routings[int(rng.integers(len(routings)))]
        n = [_n_tokens(rng, T) for _ in range(R)]
        if cfg.skip_a2a:  # every rank holds the same tokens
            n = [n[0]] * R
        excluded = ()
        if routing == "empty_src":  # some ranks (at least one; with skip_a2a all) send nothing
            if cfg.skip_a2a:
                n = [0] * R
            else:
                k = int(rng.integers(1, R + 1))
                for r in rng.choice(R, size=k, replace=False):
                    n[int(r)] = 0
        elif routing == "empty_dst":  # no token picks the experts of some ranks
            excluded = tuple(sorted(int(r) for r in rng.choice(R, size=int(rng.integers(1, most + 1)),
                                                                 replace=False)))
        weights_at = WEIGHTS_AT[int(rng.integers(3))]
        residual = weights_at != "none" and bool(rng.random() < 0.5)
        gs = float(np.float32(2.0 ** rng.uniform(-4, 4))) if c.fmt == "nvfp4" and rng.random() < 0.5 else 1.0
        out.append(Round(config=c.key, n_tokens=tuple(n), routing=routing, excluded=excluded, weights_at=weights_at,
                         residual=residual, async_dispatch=bool(rng.random() < 0.5),
                         async_combine=bool(rng.random() < 0.5), dtype="f32" if rng.random() < 0.2 else "bf16",
                         global_scale=gs, bare=R == 1 and bool(rng.random() < 0.5),
                         data_seed=int(rng.integers(2**62))))
    return configs, out


def warmup_rounds(configs: list[Config]) -> list[Round]:
    """Three rounds per configuration that touch every kernel, every lazily allocated output (weighted and
    unreduced combine) and both input dtypes, so the memory measured after them is the steady state."""
    out = []
    for i, c in enumerate(configs):
        cfg = c.ep_config()
        R, T = cfg.n_ranks, cfg.max_tokens_per_rank
        for j, (w, res, asy, dt) in enumerate([("dispatch", False, False, "bf16"), ("combine", True, True, "f32"),
                                               ("none", False, False, "bf16")]):
            out.append(Round(config=c.key, n_tokens=(T,) * R, routing="uniform", excluded=(), weights_at=w,
                             residual=res, async_dispatch=asy, async_combine=asy, dtype=dt, global_scale=1.0,
                             bare=False, data_seed=10**9 + 3 * i + j))
    return out


def counts(rounds: list[Round]) -> dict[str, dict[str, int]]:
    """Rounds per kind: by config part, routing, weights, residual, halves, dtype, and whether a rank had 0 or T."""
    out: dict[str, dict[str, int]] = {}

    def add(kind, value):
        out.setdefault(kind, {})
        out[kind][str(value)] = out[kind].get(str(value), 0) + 1

    for r in rounds:
        group, fmt, opts, small = r.config.split("/")
        T = SHAPES[group][1]
        for kind, v in (("group", group), ("format", fmt), ("options", opts), ("small", small),
                        ("routing", r.routing), ("weights_at", r.weights_at), ("residual", r.residual),
                        ("async_dispatch", r.async_dispatch), ("async_combine", r.async_combine),
                        ("dtype", r.dtype), ("bare", r.bare), ("a_rank_with_0", 0 in r.n_tokens),
                        ("a_rank_with_T", T in r.n_tokens), ("nvfp4_global_scale_1", r.global_scale == 1.0)):
            add(kind, v)
    return out


# ---- inputs (host) ------------------------------------------------------------------------------------------------
def routing_ids(rng, n: int, cfg, routing: str, excluded=()) -> np.ndarray:
    """int32 [n, K], distinct experts per row, by routing kind."""
    E, K, L = cfg.n_experts, cfg.top_k, cfg.n_local_experts
    scores = rng.random((n, E))
    if routing == "skewed":  # Zipf-like popularity over a random order of the experts
        pop = rng.permutation(E)
        scores = np.log(scores) / (1.0 + pop)[None, :] ** 1.5
    elif routing == "hot_expert":  # one expert in every row
        scores[:, int(rng.integers(E))] += 10.0
    elif routing == "empty_dst":
        for r in excluded:
            scores[:, r * L:(r + 1) * L] = -np.inf
    return np.argsort(-scores, axis=1, kind="stable")[:, :K].astype(np.int32)


def make_inputs(rnd: Round, cfg):
    """(xs, ids, ws) per rank, NumPy, from the round's seed."""
    rng = np.random.default_rng(rnd.data_seed)
    dtype = BF16 if rnd.dtype == "bf16" else np.dtype(np.float32)
    n = list(rnd.n_tokens)
    if cfg.skip_a2a:
        x = random_tokens(rng, n[0], cfg.hidden, dtype)
        ids = routing_ids(rng, n[0], cfg, rnd.routing, rnd.excluded)
        w = rng.random((n[0], cfg.top_k)).astype(np.float32)
        return [x] * cfg.n_ranks, [ids] * cfg.n_ranks, [w] * cfg.n_ranks, rng
    xs = [random_tokens(rng, k, cfg.hidden, dtype) for k in n]
    ids = [routing_ids(rng, k, cfg, rnd.routing, rnd.excluded) for k in n]
    ws = [rng.random((k, cfg.top_k)).astype(np.float32) for k in n]
    return xs, ids, ws, rng


# ---- one round on the GPU -----------------------------------------------------------------------------------------
def _call(fn, bare, *args, **kw):
    """As ep_check._call: ``fn`` on per-rank lists, or on their single entries when ``bare``; a list back."""
    if not bare:
        return fn(*args, **kw)
    one = lambda v: v[0] if isinstance(v, list) else v  # noqa: E731
    return [fn(*map(one, args), **{k: one(v) for k, v in kw.items()})]


def run_round(buf, cfg, rnd: Round) -> dict:
    """One dispatch + combine round on GPU 0 and in the reference; asserts everything matches. Returns times:
    ``gpu_ms`` (CUDA events around the dispatch and the combine calls), ``host_ms`` (host time of those calls) and
    ``round_ms`` (the whole round, reference and checks included)."""
    import cupy

    t_round = time.perf_counter()
    group = buf.group
    xs, ids, ws, rng = make_inputs(rnd, cfg)
    want = ref.dispatch([np.asarray(x) for x in xs], ids, cfg, global_scale=rnd.global_scale)
    gx, gids, gws = to_devices(group, xs), to_devices(group, ids), to_devices(group, ws)
    poison_outputs(buf, scales=False)  # (fp4: each round zeroes the padding rows the rounds before left)
    bare = rnd.bare and len(group.ranks) == 1
    wd = gws if rnd.weights_at == "dispatch" else None
    ev = [cupy.cuda.Event() for _ in range(4)]
    host = 0.0
    t = time.perf_counter()
    ev[0].record()
    if rnd.async_dispatch:
        got = _call(cuep.dispatch_wait, bare, _call(cuep.dispatch_async, bare, buf, gx, gids, wd,
                                                    global_scale=rnd.global_scale))
    else:
        got = _call(cuep.dispatch, bare, buf, gx, gids, wd, global_scale=rnd.global_scale)
    ev[1].record()
    host += time.perf_counter() - t
    buf.synchronize()
    perms = check_dispatch(buf, got, want, cfg)

    # expert outputs: random per (source, token, k) row in the reference's order, laid out in the GPU's
    cdt = BF16 if cfg.combine_dtype == "bfloat16" else np.dtype(np.float32)
    eo_ref = [rng.standard_normal((w.n_rows, cfg.hidden)).astype(cdt) for w in want]
    eo_gpu = []
    for r, perm in enumerate(perms):
        full = np.full((cfg.capacity, cfg.hidden), np.nan, dtype=cdt)  # rows past row_offsets[-1]: never read
        full[: want[r].n_rows] = eo_ref[r][perm]
        eo_gpu.append(full)
    g_eo = to_devices(group, eo_gpu)
    res_np = [rng.standard_normal((x.shape[0], cfg.hidden)).astype(cdt) for x in xs] if rnd.residual else None
    args = [buf, g_eo, got] + ([gws] if rnd.weights_at == "combine" else [])
    kw = {"residual": to_devices(group, res_np)} if rnd.residual else {}
    t = time.perf_counter()
    ev[2].record()
    if rnd.async_combine:
        _call(cuep.combine_async, bare, *args, **kw)
        out = _call(cuep.combine_wait, bare, *args, **kw)
    else:
        out = _call(cuep.combine, bare, *args, **kw)
    ev[3].record()
    host += time.perf_counter() - t
    buf.synchronize()
    wref = None if rnd.weights_at == "none" else ws
    want_c = ref.combine([e.astype(np.float32) for e in eo_ref], want, wref, cfg,
                         num_tokens=[x.shape[0] for x in xs])
    for r, o in enumerate(out):
        wc = want_c[r] + res_np[r].astype(np.float32) if rnd.residual else want_c[r]
        o = o.get().astype(np.float32)
        assert o.shape == wc.shape, (rnd, r, o.shape, wc.shape)
        if wref is None:
            np.testing.assert_array_equal(o, wc, err_msg=f"{rnd} rank {r} unreduced combine")
        else:  # float32 sums in another order: ep_check.run_round's tolerance
            scale = max(1.0, float(np.abs(wc).max())) if wc.size else 1.0
            tol = 2e-2 if cdt == BF16 else 1e-5
            np.testing.assert_allclose(o, wc, rtol=tol, atol=tol * scale, err_msg=f"{rnd} rank {r} combine")
    gpu = cupy.cuda.get_elapsed_time(ev[0], ev[1]) + cupy.cuda.get_elapsed_time(ev[2], ev[3])
    return {"gpu_ms": gpu, "host_ms": 1e3 * host, "round_ms": 1e3 * (time.perf_counter() - t_round)}


# ---- the whole soak -----------------------------------------------------------------------------------------------
def memory() -> dict[str, int]:
    """GPU 0's memory in use, after dropping garbage and the pool's cached free blocks: CuPy pool used bytes and
    the driver's free bytes (cudaMemGetInfo)."""
    import cupy

    gc.collect()
    with cupy.cuda.Device(0):
        cupy.cuda.Device().synchronize()
        pool = cupy.get_default_memory_pool()
        pool.free_all_blocks()
        free, total = cupy.cuda.runtime.memGetInfo()
        return {"pool_used_bytes": int(pool.used_bytes()), "free_bytes": int(free), "total_bytes": int(total)}


def _median(v) -> float:
    return float(np.median(v)) if len(v) else math.nan


def drift(times: dict[str, list[dict]]) -> dict[str, dict]:
    """Per config, median times of its first and last 10% of rounds (at least one round each)."""
    out = {}
    for key, ts in times.items():
        k = max(1, len(ts) // 10)
        first, last = ts[:k], ts[-k:]
        out[key] = {"rounds": len(ts), **{f"{m}_{w}": _median([t[m] for t in part]) for m in ("gpu_ms", "host_ms",
                                                                                               "round_ms")
                                          for w, part in (("first", first), ("last", last))}}
    return out


def run(seed: int, rounds: int, n_configs: int | None = None, progress_every: int = 1000, log=print) -> dict:
    """Plan, warm up, run ``rounds`` rounds, and return the summary (counts, memory before/after, drift)."""
    configs, plan_rounds = plan(seed, rounds, n_configs)
    t0 = time.perf_counter()
    bufs, cfgs = {}, {}
    groups = {g: cuep.init(devs) for g, devs in GROUPS.items()}
    for c in configs:
        cfgs[c.key] = cfg = c.ep_config()
        bufs[c.key] = cuep.Buffer(groups[c.group], cfg, timeout_s=5.0)
    for rnd in warmup_rounds(configs):
        run_round(bufs[rnd.config], cfgs[rnd.config], rnd)
    before = memory()
    log(f"soak seed={seed}: {len(configs)} configs warmed up in {time.perf_counter() - t0:.1f} s; GPU memory "
        f"{before}")
    times: dict[str, list[dict]] = {c.key: [] for c in configs}
    t1 = time.perf_counter()
    for i, rnd in enumerate(plan_rounds):
        try:
            times[rnd.config].append(run_round(bufs[rnd.config], cfgs[rnd.config], rnd))
        except Exception as e:
            raise AssertionError(f"soak seed={seed} round {i} failed: {rnd}") from e
        if progress_every and (i + 1) % progress_every == 0:
            el = time.perf_counter() - t1
            log(f"  {i + 1}/{rounds} rounds, {el:.1f} s ({1e3 * el / (i + 1):.2f} ms per round)")
    elapsed = time.perf_counter() - t1
    after = memory()
    for b in bufs.values():
        b.check()
    summary = {
        "seed": seed, "rounds": rounds, "configs": [c.key for c in configs], "elapsed_s": elapsed,
        "ms_per_round": 1e3 * elapsed / max(1, rounds), "counts": counts(plan_rounds),
        "memory_before": before, "memory_after": after, "drift": drift(times),
        "device": _device_name(),
    }
    for b in bufs.values():
        b.close()
    return summary


def _device_name() -> str:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def drift_table(summary: dict) -> str:
    """Per config: rounds, median gpu/host/round ms of the first and last 10%, and last / first of the round time."""
    lines = [f"{'config':<34} {'n':>4}  {'gpu first/last ms':>18}  {'host first/last ms':>18}  "
             f"{'round first/last ms':>19}  ratio"]
    for key, d in summary["drift"].items():
        if not d["rounds"]:
            continue
        ratio = d["round_ms_last"] / d["round_ms_first"] if d["round_ms_first"] else math.nan
        lines.append(f"{key:<34} {d['rounds']:>4}  {d['gpu_ms_first']:>8.3f}/{d['gpu_ms_last']:<9.3f}  "
                     f"{d['host_ms_first']:>8.3f}/{d['host_ms_last']:<9.3f}  {d['round_ms_first']:>9.3f}/"
                     f"{d['round_ms_last']:<9.3f}  {ratio:.2f}")
    return "\n".join(lines)


def round_dict(rnd: Round) -> dict:
    return asdict(rnd)

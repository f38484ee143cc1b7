"""A seeded generator of malformed calls against cuep's public API, and their executor (tests/test_fuzz_gpu.py).

:func:`generate` is pure NumPy (tests/test_fuzz_cpu.py checks it without a GPU): from a seed it draws cases, each
a dict of plain values: a category (:data:`CATEGORIES`), the API it targets, the argument it breaks, the buffer
("sim2": two simulated ranks, fp8; "gpu1": one real rank, nvfp4, bare arrays), the rank whose entry is broken, and
a few integers that pick the variant (dtype, offset, value, ...). :class:`Fuzz` builds the GPU state once and
:meth:`Fuzz.run` executes a case: the call either works as documented (NaN/Inf inputs, ids that are only
4-byte aligned, bad ids without ``validate``: an EPError at the next check, then ``buf.reset()``) or raises
TypeError / ValueError / RuntimeError / cuep.EPError whose message names the argument. Any other exception, or a
call that should raise and does not, fails the case.
"""
from __future__ import annotations

import math
import re

import numpy as np

CATEGORIES = ("shape", "dtype", "ndim", "host", "pylist", "none", "ids_validate", "ids_device", "nonfinite",
              "noncontig", "misaligned", "list_len", "closed", "other_buffer", "order", "scalar", "construct")

# category -> (target, argument) pairs it breaks; targets: dispatch (dispatch / dispatch_async), combine (combine /
# combine_async / combine_wait), dispatch_wait, quantize, dequantize, swizzle, fused_silu, route, moe_forward,
# init_weights, buffer (cuep.Buffer), epconfig (cuep.EPConfig), and for "order" the script's name
_ARRAYS = [("dispatch", "x"), ("dispatch", "topk_ids"), ("dispatch", "topk_weights"), ("combine", "expert_out"),
           ("combine", "topk_weights"), ("combine", "residual"), ("quantize", "x"), ("dequantize", "payload"),
           ("dequantize", "scales"), ("swizzle", "scales"), ("swizzle", "row_offsets"), ("fused_silu", "h"),
           ("fused_silu", "row_offsets"), ("moe_forward", "x")]
ORDER_SCRIPTS = ("wait_without_async", "wait_twice", "combine_wait_without_async", "dispatch_while_dispatch_pending",
                 "calls_while_combine_pending", "stale_dispatched", "reset_forgets_pending_dispatch",
                 "reset_forgets_pending_combine", "wait_on_earlier_results")
CATALOGUE = {
    "shape": _ARRAYS[:-1] + [("quantize", "out"), ("fused_silu", "out"), ("route", "router"), ("moe_forward", "x")],
    "dtype": _ARRAYS + [("route", "x"), ("route", "router")],
    "ndim": _ARRAYS + [("route", "x")],
    "host": _ARRAYS + [("route", "x")],
    "pylist": _ARRAYS + [("route", "x")],
    "none": [a for a in _ARRAYS if a != ("dispatch", "topk_weights") and a != ("combine", "topk_weights")
             and a != ("combine", "residual")]
    + [("combine", "dispatched"), ("route", "x"), ("moe_forward", "weights")],
    "ids_validate": [("dispatch", "topk_ids")],
    "ids_device": [("dispatch", "topk_ids")],
    "nonfinite": [("dispatch", "x"), ("dispatch", "topk_weights"), ("combine", "expert_out"),
                  ("combine", "topk_weights"), ("combine", "residual"), ("quantize", "x"), ("dequantize", "scales"),
                  ("fused_silu", "h"), ("route", "x"), ("moe_forward", "x")],
    "noncontig": _ARRAYS,
    "misaligned": _ARRAYS + [("route", "x"), ("route", "router")],
    "list_len": [("dispatch", "x"), ("dispatch", "topk_ids"), ("dispatch", "topk_weights"), ("combine", "expert_out"),
                 ("combine", "dispatched"), ("combine", "topk_weights"), ("combine", "residual"),
                 ("dispatch_wait", "pending"), ("moe_forward", "x"), ("moe_forward", "weights")],
    "closed": [(t, "buf") for t in ("dispatch", "combine", "dispatch_wait", "check", "synchronize", "reset",
                                    "moe_forward")],
    "other_buffer": [("combine", "dispatched"), ("dispatch_wait", "pending")],
    "order": [("order", s) for s in ORDER_SCRIPTS],
    "scalar": [("dispatch", "global_scale"), ("quantize", "fmt"), ("quantize", "global_scale"),
               ("dequantize", "hidden"), ("dequantize", "fmt"), ("swizzle", "fmt"), ("swizzle", "hidden"),
               ("fused_silu", "out_fmt"), ("fused_silu", "global_scale"), ("route", "top_k"),
               ("moe_forward", "global_scale"), ("init_weights", "intermediate"), ("init_weights", "seed"),
               ("init_weights", "devices")],
    "construct": [("epconfig", k) for k in ("hidden", "top_k", "n_experts", "max_tokens_per_rank", "n_gpus_per_node",
                                            "dispatch_format", "combine_dtype", "small_batch_tokens",
                                            "allreduce_world_size", "n_nodes")]
    + [("buffer", k) for k in ("group", "cfg", "n_ranks", "timeout_s", "num_sms", "closed_group")],
}
assert set(CATALOGUE) == set(CATEGORIES)

#: invalid values, by (target, argument); every one must raise (EPConfig's lists are checked on the CPU)
BAD_VALUES = {
    ("epconfig", "hidden"): [None, "256", 256.5, -256, 0, 100, True],
    ("epconfig", "top_k"): [0, -1, 9, None, 2.0, "2", True],
    ("epconfig", "n_experts"): [7, 0, -8, None, "8", 8.0],
    ("epconfig", "max_tokens_per_rank"): [0, -1, None, "16", 16.5, 2**40],
    ("epconfig", "n_gpus_per_node"): [0, 9, None, "2", 2.0, -1],
    ("epconfig", "dispatch_format"): ["fp16", None, 8, ""],
    ("epconfig", "combine_dtype"): ["float16", None, 1, "bf16"],
    ("epconfig", "small_batch_tokens"): [-1, "x", 2.5, 17, 10**9],
    ("epconfig", "allreduce_world_size"): [0, -1, 3, "2", None, 2.5],
    ("epconfig", "n_nodes"): [0, -1, None, "1", 1.5],
    ("buffer", "timeout_s"): [0, -1.0, math.nan, math.inf, "5", None, True],
    ("buffer", "num_sms"): [-1, 10**6, "4", 2.5, True],
    ("buffer", "group"): [None, "group", 0],
    ("buffer", "cfg"): [None, {"hidden": 256}, "cfg"],
    ("dispatch", "global_scale"): [0.0, -1.0, math.nan, math.inf, "1", None, True, 2.0**101, 2.0**-101, [1.0]],
    ("quantize", "global_scale"): [0.0, -1.0, math.nan, math.inf, "1", None, True, 2.0**101, [1.0]],
    ("fused_silu", "global_scale"): [0.0, -2.0, math.nan, math.inf, "1", None, False],
    ("moe_forward", "global_scale"): [0.0, math.nan, "1"],
    ("quantize", "fmt"): ["fp16", None, 8, "", "FP8"],
    ("dequantize", "fmt"): ["int4", None, 4],
    ("swizzle", "fmt"): ["fp8", "bf16", "x", None],
    ("fused_silu", "out_fmt"): ["e5m2", None, 3],
    ("dequantize", "hidden"): [None, "256", 256.0, True, -256, 0, 100, 2**40],
    ("swizzle", "hidden"): [None, "256", 256.5, False, -256, 0, 100],
    ("route", "top_k"): [0, 99, 2.5, None, True, "2"],
    ("init_weights", "intermediate"): [100, 0, -8, "64", None, True],
    ("init_weights", "seed"): [-1, "0", 1.5, None, True],
    ("init_weights", "devices"): [0, "0", [0, 0, 0]],
}
MISALIGN_OFFSETS = (1, 2, 4, 8, 12)


def generate(seed: int, n: int = 1200) -> list[dict]:
    """``n`` cases (at least one per category and per catalogue entry), deterministic for ``seed``."""
    rng = np.random.default_rng([seed, 22])
    entries = [(c, t, a) for c in CATEGORIES for t, a in CATALOGUE[c]]
    picks = list(range(len(entries)))  # every entry once, then random entries of random categories
    while len(picks) < n:
        c = CATEGORIES[int(rng.integers(len(CATEGORIES)))]
        opts = [i for i, e in enumerate(entries) if e[0] == c]
        picks.append(opts[int(rng.integers(len(opts)))])
    rng.shuffle(picks)
    cases = []
    for i, p in enumerate(picks[:max(n, len(entries))]):
        cat, target, arg = entries[p]
        cases.append(dict(i=i, category=cat, target=target, arg=arg, buf=("sim2", "gpu1")[int(rng.integers(2))],
                          rank=int(rng.integers(2)), fn=int(rng.integers(3)), variant=int(rng.integers(1000)),
                          offset=MISALIGN_OFFSETS[int(rng.integers(len(MISALIGN_OFFSETS)))],
                          fmt=("bf16", "fp8", "nvfp4", "mxfp4")[int(rng.integers(4))]))
    return cases


def counts(cases: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in cases:
        out[c["category"]] = out.get(c["category"], 0) + 1
    return out


def names(message: str, token: str) -> bool:
    """Does ``message`` name ``token`` as a word (``x`` in ``x[rank 0] ...``, not inside ``max``)?"""
    return re.search(rf"(?<![\w]){re.escape(token)}(?![\w])", message) is not None


# ---- construction (no GPU needed before the checks raise) ---------------------------------------------------------
STD = dict(hidden=256, top_k=2, n_experts=8, max_tokens_per_rank=16, n_gpus_per_node=2)


def construct_call(case: dict, group_factory):
    """(thunk, exception types, token) of a "construct" case. ``group_factory(n_ranks, closed)`` makes a group
    (a real one on the GPU; tests/test_fuzz_cpu.py passes a cuep.Group that never touches a device)."""
    import cuep

    target, arg, v = case["target"], case["arg"], case["variant"]
    if target == "epconfig":
        vals = BAD_VALUES[(target, arg)]
        return (lambda: cuep.EPConfig(**{**STD, arg: vals[v % len(vals)]})), (ValueError, TypeError), arg
    cfg = cuep.EPConfig(**STD)
    if arg == "n_ranks":
        return (lambda: cuep.Buffer(group_factory(3, False), cfg)), (ValueError,), "n_ranks"
    if arg == "closed_group":
        return (lambda: cuep.Buffer(group_factory(2, True), cfg)), (RuntimeError,), "group"
    vals = BAD_VALUES[(target, arg)]
    bad = vals[v % len(vals)]
    if arg == "group":
        return (lambda: cuep.Buffer(bad, cfg)), (TypeError,), "group"
    if arg == "cfg":
        return (lambda: cuep.Buffer(group_factory(2, False), bad)), (TypeError,), "cfg"
    return (lambda: cuep.Buffer(group_factory(2, False), cfg, **{arg: bad})), (ValueError,), arg


# ---- the executor (GPU) -------------------------------------------------------------------------------------------
class _Side:
    """One buffer and its valid arguments; ``d`` is always the buffer's latest finished dispatch (no weights)."""

    def __init__(self, name, cfg, devices, n_tokens, bare, rng):
        import cupy

        import cuep
        from ep_check import BF16, make_inputs, to_devices

        self.name, self.cfg, self.n, self.bare = name, cfg, list(n_tokens), bare
        self.R = len(devices)
        self.buf = cuep.Buffer(cuep.init(devices), cfg, timeout_s=5.0)
        self.other = cuep.Buffer(cuep.init(devices), cfg, timeout_s=5.0)
        self.closed = cuep.Buffer(cuep.init(devices), cfg, timeout_s=5.0)
        xs, ids, ws = make_inputs(rng, cfg, self.n)
        self.xs, self.ids, self.ws = xs, ids, ws
        g = self.buf.group
        self.gx, self.gids, self.gws = to_devices(g, xs), to_devices(g, ids), to_devices(g, ws)
        self.ys = [cupy.asarray(rng.standard_normal((cfg.capacity, cfg.hidden)).astype(BF16)) for _ in range(self.R)]
        self.ys2 = [y.copy() for y in self.ys]
        self.res = [cupy.asarray(rng.standard_normal((k, cfg.hidden)).astype(BF16)) for k in self.n]
        self.other_d = cuep.dispatch(self.other, self.pack(self.gx), self.pack(self.gids))
        self.other.synchronize()
        self.closed_d = cuep.dispatch(self.closed, self.pack(self.gx), self.pack(self.gids))
        self.closed.synchronize()
        self.closed.close()
        self.weights = None
        self.refresh()

    def pack(self, lst):
        return lst[0] if self.bare else list(lst)

    def sub(self, lst, rank, value):
        out = list(lst)
        out[rank % self.R] = value
        return self.pack(out)

    def refresh(self):
        """A valid dispatch (no weights), finished: ``d`` is the latest dispatch again."""
        import cuep

        self.d = cuep.dispatch(self.buf, self.pack(self.gx), self.pack(self.gids))
        self.buf.synchronize()

    @property
    def d_list(self):
        return [self.d] if self.bare else list(self.d)

    def moe_weights(self):
        from cuep import moe

        if self.weights is None:
            self.weights = moe.init_weights(self.cfg, 64, seed=0, devices=self.buf.group.devices)
        return self.weights

    def close(self):
        self.buf.close()
        self.other.close()


def _host(a):
    """A CuPy array's values as a NumPy array of the same dtype (bf16 included)."""
    return np.ascontiguousarray(a.view(np.uint8).get()).view(a.dtype).reshape(a.shape)


def _misaligned(a, offset: int):
    """The values of ``a`` in a C-contiguous view that starts ``offset`` bytes into a larger allocation (filled
    byte-wise: no kernel touches the view before cuep checks it)."""
    import cupy

    base = cupy.zeros(a.nbytes + 64, np.uint8)
    base[offset:offset + a.nbytes] = a.view(np.uint8).ravel()
    return cupy.ndarray(a.shape, a.dtype, memptr=base.data + offset)


def _noncontig(a, variant: int):
    """Same shape and values, not C-contiguous: every other element of a doubled allocation, or a column-major
    copy (built byte-wise, so it works for every dtype)."""
    import cupy

    s = a.dtype.itemsize
    u = a.view(np.uint8).reshape(a.shape + (s,)) if a.ndim == 1 else a.view(np.uint8).reshape(a.shape[0], -1, s)
    if a.ndim == 1 or variant % 2:  # every other element
        big = cupy.zeros(u.shape[:-1] + (2 * s,), np.uint8)
        big[..., :s] = u
        strides = (2 * s,) if a.ndim == 1 else (2 * s * a.shape[1], 2 * s)
        return cupy.ndarray(a.shape, a.dtype, memptr=big.data, strides=strides)
    t = cupy.ascontiguousarray(u.transpose(1, 0, 2))  # column-major bytes
    return cupy.ndarray(a.shape, a.dtype, memptr=t.data, strides=(s, s * a.shape[0]))


def _wrong_dtype(a, variant: int, name: str = ""):
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    if name == "row_offsets":  # any 32/64-bit integer dtype is valid there
        options = [np.int16, np.float32, np.int8, np.uint8]
        return a.astype(options[variant % len(options)])
    options = {np.dtype(np.int32): [np.int64, np.int16, np.uint32, np.float32],
               np.dtype(np.float32): [np.float64, np.float16, np.int32],
               bf16: [np.float16, np.float64, np.int32],
               np.dtype(np.uint8): [np.int8, np.uint16, np.float32],
               np.dtype(np.uint32): [np.float32, np.int16, np.int8]}[a.dtype]
    return a.astype(options[variant % len(options)])


class Fuzz:
    """GPU state for the fuzz: two sides (``sim2``: two simulated ranks, fp8, mixed staged/direct; ``gpu1``: one
    real rank, nvfp4, bare arrays), each with a second open buffer and a closed one, and per-call-kind counts."""

    def __init__(self, seed: int):
        import cuep

        rng = np.random.default_rng([seed, 1])
        self.sides = {
            "sim2": _Side("sim2", cuep.EPConfig(hidden=256, top_k=2, n_experts=8, max_tokens_per_rank=16,
                                                n_gpus_per_node=2, dispatch_format="fp8", small_batch_tokens=8),
                          [0, 0], [16, 5], False, rng),
            "gpu1": _Side("gpu1", cuep.EPConfig(hidden=256, top_k=4, n_experts=8, max_tokens_per_rank=16,
                                                n_gpus_per_node=1, dispatch_format="nvfp4"),
                          [0], [9], True, rng),
        }
        self.calls = 0
        self.outcomes: dict[str, int] = {}
        self._groups: dict = {}

    def _group(self, n: int, closed: bool):
        """One group per (ranks, closed) for the construction cases (their Buffers raise before allocating)."""
        import cuep

        if (n, closed) not in self._groups:
            g = cuep.init([0] * n)
            if closed:
                g.close()
            self._groups[n, closed] = g
        return self._groups[n, closed]

    # -- running ---------------------------------------------------------------------------------------------------
    def _expect_raise(self, case, thunk, types, token):
        self.calls += 1
        try:
            thunk()
        except types as e:
            assert names(str(e), token), f"case {case}: {type(e).__name__} does not name {token!r}: {e}"
            self._count(f"raised {type(e).__name__}")
            return
        except Exception as e:  # an unrelated exception type is a failure
            raise AssertionError(f"case {case}: expected {[t.__name__ for t in types]} naming {token!r}, got "
                                 f"{type(e).__name__}: {e}") from e
        else:
            raise AssertionError(f"case {case}: expected {[t.__name__ for t in types]} naming {token!r}; the call "
                                 f"returned")

    def _count(self, what):
        self.outcomes[what] = self.outcomes.get(what, 0) + 1

    def run(self, case: dict) -> None:
        cat = case["category"]
        s = self.sides[case["buf"]]
        if cat == "construct":
            thunk, types, token = construct_call(case, self._group)
            self._expect_raise(case, thunk, types, token)
            return
        if cat == "order":
            self._order(case, s)
            return
        if cat == "closed":
            self._closed(case, s)
            return
        getattr(self, f"_{case['target']}")(case, s)
        s.buf.check()  # nothing was left failed behind

    # -- argument mutations -----------------------------------------------------------------------------------------
    def _mutate(self, case, s, a, name, align=16, extra_shape=None):
        """(mutated array or value, expected: None = works, or (types, token))."""
        cat, v = case["category"], case["variant"]
        err = lambda *types: (types, name)  # noqa: E731
        if cat == "host":
            return _host(a), err(TypeError, ValueError)
        if cat == "pylist":
            return _host(a).tolist(), err(TypeError, ValueError)
        if cat == "none":
            return None, err(TypeError, ValueError)
        if cat == "dtype":
            return _wrong_dtype(a, v, name), err(TypeError)
        if cat == "ndim":
            return (a.reshape(-1) if a.ndim > 1 and v % 2 else a[None]), err(ValueError)
        if cat == "noncontig":
            return _noncontig(a, v), err(ValueError)
        if cat == "misaligned":
            off = case["offset"]
            return _misaligned(a, off), (err(ValueError) if off % align else None)
        if cat == "shape":
            return extra_shape(v), err(ValueError)
        raise AssertionError(f"no mutation for {case}")

    def _works_dispatch(self, s, fn, x, ids, ws, **kw):
        import cuep

        if fn == 0:
            d = cuep.dispatch(s.buf, x, ids, ws, **kw)
        else:
            d = cuep.dispatch_wait(cuep.dispatch_async(s.buf, x, ids, ws, **kw))
            self.calls += 1
        s.buf.synchronize()
        if ws is None:
            s.d = d
        else:
            s.refresh()

    def _dispatch(self, case, s):
        import cupy

        import cuep

        cat, arg, r, v = case["category"], case["arg"], case["rank"] % s.R, case["variant"]
        fn = case["fn"] % 2
        call = cuep.dispatch if fn == 0 else cuep.dispatch_async
        x, ids = s.pack(s.gx), s.pack(s.gids)
        kw = {}
        cfg = s.cfg
        T, H, K, E = cfg.max_tokens_per_rank, cfg.hidden, cfg.top_k, cfg.n_experts
        n = s.n[r]
        if arg == "global_scale":
            vals = BAD_VALUES[("dispatch", "global_scale")]
            kw["global_scale"] = vals[v % len(vals)]
            return self._expect_raise(case, lambda: call(s.buf, x, ids, **kw), (ValueError,), "global_scale")
        tok = f"{arg}[rank {s.buf._ranks[r].rank}]"
        if cat == "list_len":
            lst = {"x": s.gx, "topk_ids": s.gids, "topk_weights": s.gws}[arg]
            bad = (lst + lst[:1]) if v % 2 or s.R == 1 else lst[:1]
            if not s.bare and v % 3 == 0:
                bad = lst[0]  # a bare array for two ranks
            args = {"x": x, "topk_ids": ids, "topk_weights": s.pack(s.gws)}
            args[arg] = bad
            return self._expect_raise(case, lambda: call(s.buf, args["x"], args["topk_ids"], args["topk_weights"]),
                                      (TypeError, ValueError), arg)
        if cat in ("ids_validate", "ids_device"):
            bad = s.gids[r].copy()
            t = v % n
            kind = v % 6
            if kind == 5:
                bad[t, 1] = bad[t, 0]  # the same expert twice
            else:
                bad[t, v % K] = (E, E + 7, 2**31 - 1, -1, -5)[kind]
            ids = s.sub(s.gids, r, bad)
            if cat == "ids_validate":
                return self._expect_raise(case, lambda: call(s.buf, x, ids, validate=True), (ValueError,), tok)
            return self._bad_ids_on_device(case, s, fn, x, ids)
        if cat == "nonfinite":
            src = s.gx if arg == "x" else s.gws
            h = _host(src[r]).copy()
            rows = np.random.default_rng(v).choice(h.shape[0], size=min(3, h.shape[0]), replace=False)
            for j, row in enumerate(rows):
                h[row, (v + 37 * j) % h.shape[1]] = (np.nan, np.inf, -np.inf)[(v + j) % 3]
            bad = cupy.asarray(h)
            self.calls += 1
            if arg == "x":
                self._works_dispatch(s, fn, s.sub(s.gx, r, bad), ids, None)
            else:
                self._works_dispatch(s, fn, x, ids, s.sub(s.gws, r, bad))
            self._count("worked")
            return
        src = {"x": s.gx, "topk_ids": s.gids, "topk_weights": s.gws}[arg]
        a = src[r]

        def reshape(v):
            if arg == "x":
                return (cupy.zeros((T + 1, H), a.dtype), cupy.zeros((n, H + 8), a.dtype),
                        cupy.zeros((n, H - 128), a.dtype))[v % 3]
            return (cupy.zeros((n, K + 1), a.dtype), cupy.zeros((n, K - 1), a.dtype),
                    cupy.zeros((n + 1, K), a.dtype), cupy.zeros((n - 1, K), a.dtype))[v % 4]

        bad, expect = self._mutate(case, s, a, tok, align=16 if arg == "x" else 4, extra_shape=reshape)
        if cat in ("host", "pylist", "none") and s.bare:
            expect = (expect[0], arg)  # a bare non-array may be read as a list of rows: the message names `arg`
        args = {"x": x, "topk_ids": ids, "topk_weights": s.pack(s.gws) if arg == "topk_weights" else None}
        args[arg] = s.sub(src, r, bad)
        if expect is None:
            self.calls += 1
            self._works_dispatch(s, fn, args["x"], args["topk_ids"], args["topk_weights"])
            self._count("worked")
            return
        self._expect_raise(case, lambda: call(s.buf, args["x"], args["topk_ids"], args["topk_weights"]), *expect)

    def _bad_ids_on_device(self, case, s, fn, x, ids):
        """Without validate a bad choice is skipped on the device and reported as EPError at the next check; the
        buffer refuses rounds until reset()."""
        import cuep

        self.calls += 1
        try:
            if fn == 0:
                cuep.dispatch(s.buf, x, ids)
            else:
                pend = cuep.dispatch_async(s.buf, x, ids)
                self.calls += 1
                cuep.dispatch_wait(pend)  # may already see the error (host-mapped status)
            s.buf.synchronize()
        except cuep.EPError as e:
            assert names(str(e), "expert"), f"case {case}: {e}"
            self._count("EPError, then reset")
        else:
            raise AssertionError(f"case {case}: a bad expert id was not reported")
        try:
            cuep.dispatch(s.buf, s.pack(s.gx), s.pack(s.gids))
        except cuep.EPError:
            pass
        else:
            raise AssertionError(f"case {case}: a failed buffer accepted a dispatch before reset()")
        s.buf.reset()
        s.refresh()

    def _combine(self, case, s):
        import cupy

        import cuep

        cat, arg, r, v = case["category"], case["arg"], case["rank"] % s.R, case["variant"]
        fn = case["fn"] % 3
        call = (cuep.combine, cuep.combine_async, cuep.combine_wait)[fn]
        cfg = s.cfg
        H, K, C = cfg.hidden, cfg.top_k, cfg.capacity
        n = s.n[r]
        tok = f"{arg}[rank {s.buf._ranks[r].rank}]"
        args = {"expert_out": s.pack(s.ys), "dispatched": s.d, "topk_weights": s.pack(s.gws), "residual": None}
        if arg == "residual" or cat == "nonfinite":
            args["residual"] = s.pack(s.res)
        lists = {"expert_out": s.ys, "dispatched": s.d_list, "topk_weights": s.gws, "residual": s.res}
        go = lambda a: lambda: call(s.buf, a["expert_out"], a["dispatched"], a["topk_weights"],  # noqa: E731
                                    residual=a["residual"])
        if cat == "list_len":
            lst = lists[arg]
            bad = (lst + lst[:1]) if v % 2 or s.R == 1 else lst[:1]
            if not s.bare and v % 3 == 0:
                bad = lst[0]
            args[arg] = bad
            if arg == "dispatched" and not s.bare and v % 3 == 0:
                # one Dispatched for two ranks: dispatched must be a list
                return self._expect_raise(case, go(args), (TypeError, ValueError), "dispatched")
            return self._expect_raise(case, go(args), (TypeError, ValueError), arg)
        if cat == "other_buffer":
            args["dispatched"] = s.other_d
            return self._expect_raise(case, go(args), (ValueError,), f"dispatched[rank {s.buf._ranks[0].rank}]")
        if cat == "none" and arg == "dispatched":
            args["dispatched"] = s.sub(s.d_list, r, None)
            return self._expect_raise(case, go(args), (TypeError, ValueError), "dispatched")
        if cat == "nonfinite":
            h = _host(lists[arg][r]).copy()
            rows = np.arange(min(3, n)) if arg != "expert_out" else np.arange(3)
            for j, row in enumerate(rows):
                h[row, (v + 11 * j) % h.shape[1]] = (np.nan, np.inf, -np.inf)[(v + j) % 3]
            args[arg] = s.sub(lists[arg], r, cupy.asarray(h))
            self._works_combine(case, s, fn, args)
            return
        a = lists[arg][r]

        def reshape(v):
            if arg == "expert_out":
                return (cupy.zeros((C - 1, H), a.dtype), cupy.zeros((C, H + 8), a.dtype),
                        cupy.zeros((C, H - 8), a.dtype))[v % 3]
            if arg == "topk_weights":
                return (cupy.zeros((n + 1, K), a.dtype), cupy.zeros((n - 1, K), a.dtype),
                        cupy.zeros((n, K + 1), a.dtype))[v % 3]
            return (cupy.zeros((n + 1, H), a.dtype), cupy.zeros((n - 1, H), a.dtype),
                    cupy.zeros((n, H + 8), a.dtype))[v % 3]

        bad, expect = self._mutate(case, s, a, tok, align=4 if arg == "topk_weights" else 16, extra_shape=reshape)
        if cat in ("host", "pylist", "none") and s.bare:
            expect = (expect[0], arg)
        args[arg] = s.sub(lists[arg], r, bad)
        if expect is None:
            self._works_combine(case, s, fn, args)
            return
        self._expect_raise(case, go(args), *expect)

    def _works_combine(self, case, s, fn, args):
        import cuep

        a = (s.buf, args["expert_out"], args["dispatched"], args["topk_weights"])
        self.calls += 1
        if fn == 0:
            out = cuep.combine(*a, residual=args["residual"])
        else:
            cuep.combine_async(*a, residual=args["residual"])
            out = cuep.combine_wait(*a, residual=args["residual"])
            self.calls += 1
        s.buf.synchronize()
        for o, k in zip([out] if s.bare else out, s.n):
            assert o.shape == (k, s.cfg.hidden), (case, o.shape)
        self._count("worked")

    def _dispatch_wait(self, case, s):
        import cuep

        cat = case["category"]
        if cat == "list_len":
            bad = s.d_list[:1] if s.R > 1 else []
            return self._expect_raise(case, lambda: cuep.dispatch_wait(bad), (TypeError, ValueError), "dispatch_wait")
        if cat == "other_buffer":
            bad = [s.d_list[0], s.other_d[1]] if s.R > 1 else s.other_d
            return self._expect_raise(case, lambda: cuep.dispatch_wait(bad), (ValueError, RuntimeError),
                                      "dispatch_wait")
        raise AssertionError(case)

    # -- cuep.ops -------------------------------------------------------------------------------------------------
    def _ops_inputs(self, fmt, rows=6, hidden=256):
        import cupy

        from cuep import ops

        rng = np.random.default_rng(rows * 7 + hidden)
        x = cupy.asarray(rng.standard_normal((rows, hidden)).astype(np.float32))
        payload, scales = ops.quantize(x, fmt)
        return x, payload, scales

    def _quantize(self, case, s):
        import cupy

        from cuep import formats, ops

        cat, arg, v, fmt = case["category"], case["arg"], case["variant"], case["fmt"]
        x, payload, scales = self._ops_inputs(fmt)
        f = formats.FORMATS[fmt]
        if arg == "fmt":
            vals = BAD_VALUES[("quantize", "fmt")]
            return self._expect_raise(case, lambda: ops.quantize(x, vals[v % len(vals)]), (ValueError,), "fmt")
        if arg == "global_scale":
            vals = BAD_VALUES[("quantize", "global_scale")]
            return self._expect_raise(case, lambda: ops.quantize(x, "nvfp4", vals[v % len(vals)]), (ValueError,),
                                      "global_scale")
        if arg == "out":
            good = (cupy.empty_like(payload), cupy.empty_like(scales))
            bad = ((good[0][:, :-1].copy(), good[1]), (good[0], cupy.empty((7, scales.shape[1]), np.uint8)),
                   good[:1], list(good) + [good[0]], good[0])[v % 5]
            return self._expect_raise(case, lambda: ops.quantize(x, fmt, out=bad), (TypeError, ValueError), "out")
        if cat == "nonfinite":
            h = x.get()
            h[v % 6, (v * 13) % 256] = (np.nan, np.inf, -np.inf)[v % 3]
            self.calls += 1
            p, sc = ops.quantize(cupy.asarray(h), fmt)
            cupy.cuda.get_current_stream().synchronize()
            assert p.shape == payload.shape and sc.shape == scales.shape
            self._count("worked")
            return
        bad, expect = self._mutate(case, s, x, "x", extra_shape=lambda v: cupy.zeros((6, 256 + f.group // 2),
                                                                                        np.float32))
        self._expect_raise(case, lambda: ops.quantize(bad, fmt), *expect)

    def _dequantize(self, case, s):
        import cupy

        from cuep import ops

        cat, arg, v = case["category"], case["arg"], case["variant"]
        fmt = ("fp8", "nvfp4", "mxfp4")[v % 3]  # formats with scales: every mutation of them is visible
        x, payload, scales = self._ops_inputs(fmt)
        if arg == "hidden":
            vals = BAD_VALUES[("dequantize", "hidden")]
            return self._expect_raise(case, lambda: ops.dequantize(payload, scales, fmt, vals[v % len(vals)]),
                                      (ValueError,), "hidden")
        if arg == "fmt":
            vals = BAD_VALUES[("dequantize", "fmt")]
            return self._expect_raise(case, lambda: ops.dequantize(payload, scales, vals[v % len(vals)], 256),
                                      (ValueError,), "fmt")
        if cat == "nonfinite":  # every scale byte pattern, NaN scales included: decodes without an error
            sc = cupy.asarray(np.random.default_rng(v).integers(0, 256, size=scales.shape, dtype=np.uint8))
            if fmt == "fp8":
                sc.view(np.float32)[0, 0] = np.float32(np.nan)
            self.calls += 1
            out = ops.dequantize(payload, sc, fmt, 256)
            cupy.cuda.get_current_stream().synchronize()
            assert out.shape == (6, 256)
            self._count("worked")
            return
        a = payload if arg == "payload" else scales
        shape = (lambda v: cupy.zeros((6, payload.shape[1] + 16), np.uint8)) if arg == "payload" else \
            (lambda v: cupy.zeros((7, scales.shape[1]), np.uint8))
        bad, expect = self._mutate(case, s, a, arg, extra_shape=shape)
        args = {"payload": payload, "scales": scales, arg: bad}
        self._expect_raise(case, lambda: ops.dequantize(args["payload"], args["scales"], fmt, 256), *expect)

    def _swizzle(self, case, s):
        import cupy

        from cuep import ops

        arg, v = case["arg"], case["variant"]
        fmt = ("nvfp4", "mxfp4")[v % 2]
        _, _, scales = self._ops_inputs(fmt)
        ro = cupy.asarray(np.array([0, 2, 6], np.int32))
        if arg in ("fmt", "hidden"):
            vals = BAD_VALUES[("swizzle", arg)]
            bad = vals[v % len(vals)]
            kw = {"fmt": fmt, "hidden": 256, arg: bad}
            return self._expect_raise(case, lambda: ops.swizzle_block_scales(scales, ro, kw["fmt"], kw["hidden"]),
                                      (ValueError,), arg)
        a = scales if arg == "scales" else ro
        shape = (lambda v: cupy.zeros((6, scales.shape[1] + 1), np.uint8)) if arg == "scales" else \
            (lambda v: (cupy.zeros((1,), np.int32), cupy.zeros((5000,), np.int32))[v % 2])
        bad, expect = self._mutate(case, s, a, arg, extra_shape=shape)
        args = {"scales": scales, "row_offsets": ro, arg: bad}
        self._expect_raise(case, lambda: ops.swizzle_block_scales(args["scales"], args["row_offsets"], fmt, 256),
                           *expect)

    def _fused_silu(self, case, s):
        import cupy

        from cuep import ops

        cat, arg, v, fmt = case["category"], case["arg"], case["variant"], case["fmt"]
        rng = np.random.default_rng(v)
        h = cupy.asarray(rng.standard_normal((8, 512)).astype(np.float32))
        ro = cupy.asarray(np.array([0, 3, 8], np.int32))
        if arg in ("out_fmt", "global_scale"):
            vals = BAD_VALUES[("fused_silu", arg)]
            kw = {"out_fmt": "nvfp4", "global_scale": 1.0, arg: vals[v % len(vals)]}
            return self._expect_raise(case, lambda: ops.fused_silu(h, ro, kw["out_fmt"], False, kw["global_scale"]),
                                      (ValueError,), arg)
        if arg == "out":  # I = 256: bf16 out [8, 256] bf16; fp8 out (payload [8, 256] uint8, scales [2, 8] f32)
            bf16 = np.dtype(__import__("ml_dtypes").bfloat16)
            out_fmt, bad = (("fp8", cupy.empty((8, 256), np.uint8)), ("fp8", (cupy.empty((8, 256), np.uint8),)),
                            ("bf16", cupy.empty((7, 256), bf16)), ("bf16", cupy.empty((8, 256), np.float32)),
                            ("fp8", (cupy.empty((8, 255), np.uint8), cupy.empty((2, 8), np.float32))))[v % 5]
            return self._expect_raise(case, lambda: ops.fused_silu(h, ro, out_fmt, out=bad), (TypeError, ValueError),
                                      "out")
        if cat == "nonfinite":
            hh = h.get()
            hh[v % 8, (v * 7) % 512] = (np.nan, np.inf, -np.inf)[v % 3]
            self.calls += 1
            out = ops.fused_silu(cupy.asarray(hh), ro, fmt, bool(v % 2))
            cupy.cuda.get_current_stream().synchronize()
            assert (out if fmt == "bf16" else out[0]).shape[0] == 8
            self._count("worked")
            return
        a = h if arg == "h" else ro
        shape = (lambda v: cupy.zeros((8, (513, 2 * (256 + 4))[v % 2]), np.float32)) if arg == "h" else \
            (lambda v: (cupy.zeros((1,), np.int32), cupy.zeros((5000,), np.int32))[v % 2])
        out_fmt = fmt if arg == "h" else "bf16"  # h's widths 513 and 520 (I = 260) are invalid for every format
        bad, expect = self._mutate(case, s, a, arg, extra_shape=shape)
        args = {"h": h, "row_offsets": ro, arg: bad}
        self._expect_raise(case, lambda: ops.fused_silu(args["h"], args["row_offsets"], out_fmt), *expect)

    # -- cuep.moe -------------------------------------------------------------------------------------------------
    def _route(self, case, s):
        import cupy

        from cuep import moe

        cat, arg, v = case["category"], case["arg"], case["variant"]
        rng = np.random.default_rng(v)
        x = cupy.asarray(rng.standard_normal((5, 64)).astype(np.float32))
        router = cupy.asarray(rng.standard_normal((64, 8)).astype(np.float32))
        if arg == "top_k":
            vals = BAD_VALUES[("route", "top_k")]
            return self._expect_raise(case, lambda: moe.route(x, router, vals[v % len(vals)]), (ValueError,),
                                      "top_k")
        if cat == "nonfinite":
            xh = _host(x).copy()
            xh[v % 5, v % 64] = (np.nan, np.inf, -np.inf)[v % 3]
            self.calls += 1
            ids, w = moe.route(cupy.asarray(xh), router, 2)
            assert ids.shape == (5, 2) and w.shape == (5, 2)
            self._count("worked")
            return
        a = x if arg == "x" else router
        if cat == "misaligned":
            off = case["offset"]
            off = off if off % a.dtype.itemsize else 1
            bad, expect = _misaligned(a, off), ((ValueError,), arg)
        else:
            bad, expect = self._mutate(case, s, a, arg, extra_shape=lambda v: cupy.zeros((72, 8), np.float32))
        if cat == "host":  # the host path is valid, but not with the other argument on the GPU
            expect = ((ValueError,), arg)
        args = {"x": x, "router": router, arg: bad}
        self._expect_raise(case, lambda: moe.route(args["x"], args["router"], 2), *expect)

    def _moe_forward(self, case, s):
        import cupy

        from cuep import moe

        cat, arg, r, v = case["category"], case["arg"], case["rank"] % s.R, case["variant"]
        w = s.moe_weights()
        tok = f"x[rank {s.buf._ranks[r].rank}]"
        if arg == "global_scale":
            vals = BAD_VALUES[("moe_forward", "global_scale")]
            self._expect_raise(case, lambda: moe.moe_forward(s.buf, s.pack(s.gx), s.pack(w),
                                                             global_scale=vals[v % len(vals)]), (ValueError,),
                               "global_scale")
            return
        if arg == "weights":
            if cat == "list_len":
                bad = (w + w[:1]) if s.R == 1 or v % 2 else w[:1]
            else:
                bad = None
            return self._expect_raise(case, lambda: moe.moe_forward(s.buf, s.pack(s.gx), bad),
                                      (TypeError, ValueError), "weights")
        if cat == "list_len":
            bad = (s.gx + s.gx[:1]) if s.R == 1 or v % 2 else s.gx[:1]
            return self._expect_raise(case, lambda: moe.moe_forward(s.buf, bad, s.pack(w)), (ValueError,), "x")
        if cat == "nonfinite":
            h = _host(s.gx[r]).copy()
            h[v % s.n[r], v % s.cfg.hidden] = (np.nan, np.inf, -np.inf)[v % 3]
            self.calls += 1
            out = moe.moe_forward(s.buf, s.sub(s.gx, r, cupy.asarray(h)), s.pack(w))
            s.buf.synchronize()
            assert len([out] if s.bare else out) == s.R
            s.refresh()  # the layer dispatched: d is the latest dispatch again
            self._count("worked")
            return
        T, H = s.cfg.max_tokens_per_rank, s.cfg.hidden
        shape = lambda v: (cupy.zeros((T + 1, H), s.gx[r].dtype), cupy.zeros((4, 128), s.gx[r].dtype))[v % 2]  # noqa
        bad, expect = self._mutate(case, s, s.gx[r], tok, extra_shape=shape)
        if cat in ("host", "pylist", "none") and s.bare:
            expect = (expect[0], "x")
        self._expect_raise(case, lambda: moe.moe_forward(s.buf, s.sub(s.gx, r, bad), s.pack(w)), *expect)

    def _init_weights(self, case, s):
        from cuep import moe

        arg, v = case["arg"], case["variant"]
        vals = BAD_VALUES[("init_weights", arg)]
        kw = {"intermediate": 64, "seed": 0, "devices": None, arg: vals[v % len(vals)]}
        self._expect_raise(case, lambda: moe.init_weights(s.cfg, kw["intermediate"], kw["seed"], kw["devices"]),
                           (TypeError, ValueError), arg)

    # -- closed buffers, and the order of round halves ---------------------------------------------------------
    def _closed(self, case, s):
        import cuep
        from cuep import moe

        c, t = s.closed, case["target"]
        thunk = {
            "dispatch": lambda: (cuep.dispatch, cuep.dispatch_async)[case["fn"] % 2](c, s.pack(s.gx), s.pack(s.gids)),
            "combine": lambda: (cuep.combine, cuep.combine_async, cuep.combine_wait)[case["fn"] % 3](
                c, s.pack(s.ys), s.closed_d),
            "dispatch_wait": lambda: cuep.dispatch_wait(s.closed_d),
            "check": c.check, "synchronize": c.synchronize, "reset": c.reset,
            "moe_forward": lambda: moe.moe_forward(c, s.pack(s.gx), s.pack(s.moe_weights())),
        }[t]
        self._expect_raise(case, thunk, (RuntimeError,), "Buffer")

    def _order(self, case, s):
        import cuep

        b, x, ids = s.buf, s.pack(s.gx), s.pack(s.gids)
        ys, ys2 = s.pack(s.ys), s.pack(s.ys2)
        script = case["arg"]
        ok = lambda: self._count("worked")  # noqa: E731

        def step(fn):
            self.calls += 1
            out = fn()
            ok()
            return out

        def bad(fn, types, token):
            self._expect_raise(case, fn, types, token)

        if script == "wait_without_async":
            bad(lambda: cuep.dispatch_wait(s.d), (RuntimeError,), "dispatch_wait")
        elif script == "wait_twice":
            pend = step(lambda: cuep.dispatch_async(b, x, ids))
            s.d = step(lambda: cuep.dispatch_wait(pend))
            bad(lambda: cuep.dispatch_wait(pend), (RuntimeError,), "dispatch_wait")
        elif script == "combine_wait_without_async":
            bad(lambda: cuep.combine_wait(b, ys, s.d), (RuntimeError,), "combine_wait")
        elif script == "dispatch_while_dispatch_pending":
            pend = step(lambda: cuep.dispatch_async(b, x, ids))
            bad(lambda: cuep.dispatch(b, x, ids), (RuntimeError,), "dispatch_async")
            bad(lambda: cuep.dispatch_async(b, x, ids), (RuntimeError,), "dispatch_async")
            bad(lambda: cuep.combine(b, ys, pend), (RuntimeError,), "dispatch_async")
            bad(lambda: cuep.combine_async(b, ys, pend), (RuntimeError,), "dispatch_async")
            bad(lambda: cuep.combine_wait(b, ys, pend), (RuntimeError,), "combine_wait")
            s.d = step(lambda: cuep.dispatch_wait(pend))
        elif script == "calls_while_combine_pending":
            step(lambda: cuep.combine_async(b, ys, s.d))
            bad(lambda: cuep.dispatch(b, x, ids), (RuntimeError,), "combine_async")
            bad(lambda: cuep.dispatch_async(b, x, ids), (RuntimeError,), "combine_async")
            bad(lambda: cuep.combine(b, ys, s.d), (RuntimeError,), "combine_async")
            bad(lambda: cuep.combine_async(b, ys, s.d), (RuntimeError,), "combine_async")
            bad(lambda: cuep.dispatch_wait(s.d), (RuntimeError,), "dispatch_wait")
            bad(lambda: cuep.combine_wait(b, ys, s.d, s.pack(s.gws)), (ValueError,), "topk_weights")
            bad(lambda: cuep.combine_wait(b, ys2, s.d), (ValueError,), "expert_out")
            step(lambda: cuep.combine_wait(b, ys, s.d))
            bad(lambda: cuep.combine_wait(b, ys, s.d), (RuntimeError,), "combine_wait")
        elif script == "stale_dispatched":
            old = s.d
            s.d = step(lambda: cuep.dispatch(b, x, ids))
            bad(lambda: cuep.combine(b, ys, old), (ValueError,), f"dispatched[rank {b._ranks[0].rank}]")
            step(lambda: cuep.combine(b, ys, s.d))
        elif script == "reset_forgets_pending_dispatch":
            step(lambda: cuep.dispatch_async(b, x, ids))
            step(b.reset)
            s.refresh()
        elif script == "reset_forgets_pending_combine":
            step(lambda: cuep.combine_async(b, ys, s.d))
            step(b.reset)
            s.refresh()
        elif script == "wait_on_earlier_results":
            old = s.d
            pend = step(lambda: cuep.dispatch_async(b, x, ids))
            bad(lambda: cuep.dispatch_wait(old), (ValueError,), "dispatch_wait")
            s.d = step(lambda: cuep.dispatch_wait(pend))
        else:
            raise AssertionError(script)
        b.synchronize()
        assert b._rounds["pending"] is None, (case, b._rounds)

    def close(self):
        for s in self.sides.values():
            s.close()

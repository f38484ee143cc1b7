"""A small, readable Mixture-of-Experts layer built only from cuep and CuPy (and its dense NumPy reference).

One layer call on every local rank::

    x [N, H] --route--> topk_ids [N, K], topk_weights [N, K]        softmax over E logits, top-k, renormalised
      --dispatch-->     rows grouped by local expert (dispatch format: bf16 / fp8 / nvfp4 / mxfp4)
      --experts-->      per group g: dequantize -> x_g @ w_gate_up[e] -> fused SwiGLU -> @ w_down[e]   (cuBLAS)
      --combine-->      out [N, H] = sum_k w[t, k] * expert_k(x[t])  (+ shared expert(x[t]) when fused)

The expert GEMMs are a plain loop of ``cupy.matmul`` over the groups of ``row_offsets``, so the host reads the
group sizes once per call (one synchronisation per rank). That is fine for a reference layer; a production layer
would run one grouped GEMM that reads ``row_offsets`` on the device and keep the round free of host syncs.

Sharding (expert parallelism): rank r holds the routed experts ``r * L .. r * L + L - 1`` (L = E / R, as dispatch
places them), stacked as local experts 0 .. L-1, and, with ``cfg.fused_shared_expert``, a copy of the shared
expert stacked after them as local expert L (``cfg.shared_expert_id``); the router is replicated on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

# cupy is imported inside the functions that use it (as in ops.py): `import cuep` stays cheap and loads no CUDA
# library; the host path (NumPy arrays) only asks it which module an array belongs to.
import ml_dtypes
import numpy as np

from . import ops
from . import reference
from .config import EPConfig
from .ep import _check_array, _check_buffer, combine, dispatch
from .interop import as_cupy, is_torch_tensor, torch_aware
from .formats import SCALE_TILE_BYTES, SCALE_TILE_COLS, SCALE_TILE_ROWS

__all__ = ["MoEWeights", "init_weights", "route", "moe_forward", "moe_reference", "PHASES"]

BF16 = np.dtype(ml_dtypes.bfloat16)
_F32 = np.dtype(np.float32)

PHASES = ("router", "dispatch", "experts", "combine")
"""The phases :func:`moe_forward` times (``timings`` keys, in order); dispatch and combine are communication."""


# ---- weights --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoEWeights:
    """One rank's share of the layer's weights (NumPy or CuPy arrays, or torch CUDA tensors, held as zero-copy CuPy
    views; :func:`init_weights` makes them).

    Attributes:
        w_gate_up: bfloat16 [G, H, 2I]: per held expert, the gate projection (columns 0 .. I-1) then the up
            projection (columns I .. 2I-1). G = L routed experts (the rank's, global ids ``rank * L + l``), plus
            the shared expert as local expert L when ``cfg.fused_shared_expert``.
        w_down: bfloat16 [G, I, H]: the down projection of the same experts.
        router: float32 [H, E]: router logits are ``x @ router``; identical on every rank.
    """

    w_gate_up: object
    w_down: object
    router: object

    def __post_init__(self) -> None:
        for name in ("w_gate_up", "w_down", "router"):  # torch CUDA tensors are held as zero-copy CuPy views
            if is_torch_tensor(getattr(self, name)):
                object.__setattr__(self, name, as_cupy(getattr(self, name), name))
        g, h, i2 = _shape(self.w_gate_up, "w_gate_up", 3)
        if i2 % 2:
            raise ValueError(f"w_gate_up has shape {self.w_gate_up.shape}; its last axis must be 2I (gate | up)")
        if tuple(_shape(self.w_down, "w_down", 3)) != (g, i2 // 2, h):
            raise ValueError(f"w_down has shape {self.w_down.shape}; expected ({g}, {i2 // 2}, {h}) = (experts, I, H) "
                             f"to match w_gate_up {self.w_gate_up.shape}")
        if _shape(self.router, "router", 2)[0] != h:
            raise ValueError(f"router has shape {self.router.shape}; expected ({h}, n_experts)")
        for name, want in (("w_gate_up", BF16), ("w_down", BF16), ("router", _F32)):
            if getattr(self, name).dtype != want:
                raise TypeError(f"{name} has dtype {getattr(self, name).dtype}; expected {want}")

    @property
    def n_held(self) -> int:
        """G: experts stacked on this rank (L, or L + 1 with the shared expert)."""
        return int(self.w_gate_up.shape[0])

    @property
    def hidden(self) -> int:
        return int(self.w_gate_up.shape[1])

    @property
    def intermediate(self) -> int:
        return int(self.w_gate_up.shape[2]) // 2

    def to_numpy(self) -> "MoEWeights":
        """The same weights as NumPy arrays (copied from the GPU if they live there), e.g. for :func:`moe_reference`."""
        import cupy
        get = lambda a: a.get() if isinstance(a, cupy.ndarray) else np.asarray(a)  # noqa: E731
        return MoEWeights(get(self.w_gate_up), get(self.w_down), get(self.router))


def _shape(a, name: str, ndim: int) -> tuple:
    shape = getattr(a, "shape", None)
    if shape is None or len(shape) != ndim:
        raise ValueError(f"{name} must be a {ndim}-D array, got {type(a).__name__} of shape {shape}")
    return tuple(shape)


def _expert_rng(seed: int, *key: int) -> np.random.Generator:
    """A generator per weight tensor, keyed by (seed, kind, expert): the model does not depend on the sharding."""
    return np.random.default_rng([seed, *key])


def init_weights(cfg: EPConfig, intermediate: int, seed: int = 0, devices=None, ranks=None) -> list[MoEWeights]:
    """Random weights of one layer, sharded as expert parallelism places them.

    Every tensor comes from its own generator keyed by ``(seed, expert)``, so the same seed gives the same model
    for any number of ranks (on the GPU or on the host). Scales keep activations O(1) for O(1) inputs:
    w_gate_up ~ N(0, 1/H), w_down ~ N(0, 1/I), router ~ N(0, 1/H).

    Args:
        cfg: the group's sizes (H = ``cfg.hidden``, E, L, and whether there is a fused shared expert).
        intermediate: I, the expert MLP's inner width (a multiple of 8, as :func:`cuep.ops.fused_silu` needs).
        seed: non-negative int.
        devices: CUDA device of each rank in ``ranks`` (CuPy arrays there), or None for NumPy arrays on the host.
        ranks: the global ranks to build (default all ``cfg.n_ranks``; one process per GPU passes its own).

    Returns:
        list of :class:`MoEWeights`, one per rank in ``ranks``: w_gate_up bf16 [G, H, 2I], w_down bf16 [G, I, H],
        router float32 [H, E], G = ``cfg.n_groups``.
    """
    if not isinstance(cfg, EPConfig):
        raise TypeError(f"cfg must be an EPConfig, got {type(cfg).__name__}")
    if isinstance(intermediate, bool) or not isinstance(intermediate, (int, np.integer)) or intermediate < 1 \
            or intermediate % 8:
        raise ValueError(f"intermediate={intermediate!r} must be a positive multiple of 8")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative int")
    ranks = list(range(cfg.n_ranks)) if ranks is None else [int(r) for r in ranks]
    if any(not 0 <= r < cfg.n_ranks for r in ranks):
        raise ValueError(f"ranks={ranks} must lie in [0, cfg.n_ranks={cfg.n_ranks})")
    if devices is not None and (isinstance(devices, (int, str)) or not hasattr(devices, "__len__")):
        raise TypeError(f"devices must be a list of CUDA device ids, one per rank, e.g. [0, 1]; got {devices!r}")
    if devices is not None and len(devices) != len(ranks):
        raise ValueError(f"devices has {len(devices)} entries; expected one per rank ({len(ranks)})")
    H, I, E, L = cfg.hidden, int(intermediate), cfg.n_experts, cfg.n_local_experts

    def expert(key) -> tuple[np.ndarray, np.ndarray]:
        rng = _expert_rng(seed, *key)
        up = rng.standard_normal((H, 2 * I), dtype=np.float32) / np.float32(np.sqrt(H))
        down = rng.standard_normal((I, H), dtype=np.float32) / np.float32(np.sqrt(I))
        return up.astype(BF16), down.astype(BF16)

    router = _expert_rng(seed, 2).standard_normal((H, E), dtype=np.float32) / np.float32(np.sqrt(H))
    shared = expert((1,)) if cfg.fused_shared_expert else None
    out = []
    for i, r in enumerate(ranks):
        held = [expert((0, r * L + l)) for l in range(L)] + ([shared] if shared else [])
        arrays = (np.stack([u for u, _ in held]), np.stack([d for _, d in held]), router.copy())
        if devices is not None:
            import cupy
            with cupy.cuda.Device(int(devices[i])):
                arrays = tuple(cupy.asarray(a) for a in arrays)
        out.append(MoEWeights(*arrays))
    return out


# ---- router ---------------------------------------------------------------------------------------------------
@torch_aware
def route(x, router, top_k: int):
    """Softmax over the E router logits, top-k, weights renormalised to sum to 1 (NumPy or CuPy arrays).

    Args:
        x: [N, H] bfloat16 or float32 tokens.
        router: float32 [H, E].
        top_k: K <= E.

    Returns:
        ``(topk_ids, topk_weights)``: int32 [N, K] (the K experts of largest logit, best first) and float32 [N, K]
        (``softmax(logits)[ids] / sum``), C-contiguous, on the same side as ``x``. Logits are a float32 GEMM.
    """
    import cupy
    _check_route_args(x, router, top_k)
    xp = cupy.get_array_module(x)
    n = x.shape[0]
    if n == 0:
        return xp.zeros((0, top_k), np.int32), xp.zeros((0, top_k), np.float32)
    logits = xp.matmul(x.astype(np.float32), router)                          # [N, E]
    probs = xp.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    ids = xp.argsort(-logits, axis=1)[:, :top_k]
    weights = xp.take_along_axis(probs, ids, axis=1)
    weights /= weights.sum(axis=1, keepdims=True)
    return xp.ascontiguousarray(ids.astype(np.int32)), xp.ascontiguousarray(weights.astype(np.float32))


def _check_route_args(x, router, top_k) -> None:
    """route's arguments: x [N, H] bf16/float32 and router float32 [H, E], both NumPy or both CuPy (same GPU)."""
    import cupy
    for name, a in (("x", x), ("router", router)):
        if not isinstance(a, (np.ndarray, cupy.ndarray)):
            raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(a).__name__}")
        if a.ndim != 2:
            raise ValueError(f"{name} must be 2-D ({'[N, H]' if name == 'x' else '[H, n_experts]'}), got shape "
                             f"{a.shape}")
        if isinstance(a, cupy.ndarray) and a.size and a.data.ptr % a.dtype.itemsize:
            raise ValueError(f"{name} starts at address {a.data.ptr:#x}, not on a {a.dtype.itemsize}-byte boundary "
                             f"(its dtype's size): pass a fresh array, e.g. {name}.copy()")
    if x.dtype not in (BF16, _F32):
        raise TypeError(f"x has dtype {x.dtype}; expected bfloat16 or float32")
    if router.dtype != _F32:
        raise TypeError(f"router has dtype {router.dtype}; expected float32")
    if type(x) is not type(router) or (isinstance(x, cupy.ndarray) and x.device.id != router.device.id):
        where = lambda a: f"GPU {a.device.id}" if isinstance(a, cupy.ndarray) else "the host"  # noqa: E731
        raise ValueError(f"x is on {where(x)} but router on {where(router)}: both must be on the same side")
    if router.shape[0] != x.shape[1]:
        raise ValueError(f"router has shape {router.shape}; expected ({x.shape[1]}, n_experts) for x of shape "
                         f"{x.shape}")
    e = router.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k!r} must be an int in [1, n_experts={e}]")


# ---- experts: one rank's dispatch output -> expert outputs ------------------------------------------------------
def _scale_rows(d, rows: int, cfg: EPConfig):
    """The dispatch ``scales`` layout -> per-row scale bytes uint8 [rows, scale_bytes(H)], as dequantize takes them.

    fp8: float32 [H/128, capacity] transposed back. nvfp4/mxfp4: gathered from the 128x4 tiles; group g's rows start
    at scale row ``(row_offsets[g] // 128 + scales_offsets[g]) * 128`` (docs/formats.md). NumPy or CuPy, no sync.
    """
    import cupy
    xp = cupy.get_array_module(d.row_offsets)
    f, H = cfg.fmt, cfg.hidden
    if f.name == "bf16":
        return xp.zeros((rows, 0), np.uint8)
    if f.name == "fp8":
        return xp.ascontiguousarray(d.scales[:, :rows].T).view(np.uint8)
    ro = d.row_offsets.astype(np.int64)
    i = xp.arange(rows, dtype=np.int64)
    g = xp.searchsorted(ro[1:], i, side="right")                               # the group of each row
    sr = ((ro[g] // SCALE_TILE_ROWS + d.scales_offsets.astype(np.int64)[g]) * SCALE_TILE_ROWS + i - ro[g])[:, None]
    c = xp.arange(f.n_scales(H), dtype=np.int64)[None, :]
    offset = (((sr // SCALE_TILE_ROWS) * f.scale_k_tiles(H) + c // SCALE_TILE_COLS) * SCALE_TILE_BYTES
              + (sr % 32) * 16 + ((sr % SCALE_TILE_ROWS) // 32) * 4 + c % SCALE_TILE_COLS)
    return d.scales[offset]


def _expert_inputs(d, rows: int, cfg: EPConfig, global_scale: float):
    """bfloat16 [rows, H]: the dispatched rows, dequantized (GPU: cuep.ops; host: cuep.reference) for the GEMMs."""
    import cupy
    if cfg.fmt.name == "bf16":
        return d.tokens[:rows]
    xp = cupy.get_array_module(d.tokens)
    deq = ops.dequantize if xp is cupy else reference.dequantize
    x = deq(d.tokens[:rows], _scale_rows(d, rows, cfg), cfg.fmt.name, cfg.hidden, global_scale)
    return x.astype(BF16)


def _expert_outputs(d, w: MoEWeights, cfg: EPConfig, global_scale: float, out):
    """Run every expert on its group of one rank's dispatch output: ``out[i] = expert(row i)``, i < row_offsets[-1].

    Works on a :class:`cuep.Dispatched` (CuPy: cuBLAS GEMMs, ``cuep.ops.fused_silu``) and on a
    :class:`cuep.reference.Dispatched` (NumPy: ``cuep.reference.fused_silu``), so the host can check this glue.

    Args:
        d: the rank's dispatch result.
        w: the rank's weights (same side as ``d``).
        out: [>= rows, H] in the combine dtype; rows at or past ``row_offsets[-1]`` are left as they were.
    Returns:
        ``out``.
    """
    import cupy
    xp = cupy.get_array_module(d.row_offsets)
    # The one host read of the layer: group sizes and their experts drive the loop of GEMMs below.
    head = xp.concatenate([d.row_offsets.astype(np.int64), d.expert_ids.astype(np.int64)])
    head = head.get() if xp is cupy else head
    n_groups = d.expert_ids.shape[0]
    offsets, experts = head[: n_groups + 1].tolist(), head[n_groups + 1:].tolist()
    rows = offsets[-1]
    x = _expert_inputs(d, rows, cfg, global_scale)                           # bf16 [rows, H]
    h = xp.empty((rows, 2 * w.intermediate), BF16)                           # gate | up
    for g, e in enumerate(experts):
        a, b = offsets[g], offsets[g + 1]
        if b > a:
            h[a:b] = xp.matmul(x[a:b], w.w_gate_up[e])
    silu = ops.fused_silu if xp is cupy else reference.fused_silu
    act = silu(h, d.row_offsets)                                             # bf16 [rows, I]: silu(gate) * up
    for g, e in enumerate(experts):
        a, b = offsets[g], offsets[g + 1]
        if b > a:
            out[a:b] = xp.matmul(act[a:b], w.w_down[e])
    return out


# ---- the layer ----------------------------------------------------------------------------------------------------
class _PhaseTimer:
    """CUDA events at the phase boundaries, on every device's current stream (only when timings are asked for)."""

    def __init__(self, devices, enabled: bool):
        self.devices = list(dict.fromkeys(devices)) if enabled else []
        self.marks: list[list] = []

    def mark(self) -> None:
        import cupy
        events = []
        for dev in self.devices:
            with cupy.cuda.Device(dev):
                ev = cupy.cuda.Event()
                ev.record()
                events.append(ev)
        if events:
            self.marks.append(events)

    def elapsed_ms(self, names) -> dict[str, float]:
        """Per phase, the longest time any device spent in it; ``total`` from the first mark to the last."""
        import cupy
        for ev in self.marks[-1]:
            ev.synchronize()
        span = lambda i, j: max(cupy.cuda.get_elapsed_time(a, b)  # noqa: E731
                                for a, b in zip(self.marks[i], self.marks[j]))
        out = {name: span(i, i + 1) for i, name in enumerate(names)}
        out["total"] = span(0, len(names))
        return out


def _check_forward_args(buf, xs, ws) -> None:
    import cupy
    _check_buffer(buf, "moe_forward")
    buf.check()
    cfg = buf.cfg
    if cfg.skip_a2a:
        raise ValueError("moe_forward needs every token sent to its experts; cfg.skip_a2a gives per-rank partial "
                         "sums that need an all-reduce afterwards (not part of this layer)")
    n = buf.group.n_local
    for name, v in (("x", xs), ("weights", ws)):
        if len(v) != n:
            raise ValueError(f"{name} has {len(v)} entries; this process drives {n} rank(s), one each")
    for i, (x, w, dev, rank) in enumerate(zip(xs, ws, buf.group.devices, buf.group.ranks)):
        tag = f"[rank {rank}]"
        if not isinstance(w, MoEWeights):
            raise TypeError(f"weights{tag} must be a MoEWeights, got {type(w).__name__}")
        for name in ("w_gate_up", "w_down", "router"):
            a = getattr(w, name)
            if not isinstance(a, cupy.ndarray) or a.device.id != dev:
                got = f"a cupy array on GPU {a.device.id}" if isinstance(a, cupy.ndarray) else \
                    f"a {type(a).__module__.split('.')[0]}.{type(a).__name__} (host memory)"
                raise ValueError(f"weights{tag}.{name} must be a cupy array on GPU {dev}, got {got}: build the "
                                 f"weights with init_weights(cfg, I, devices=buf.group.devices)")
        if w.n_held != cfg.n_groups or w.hidden != cfg.hidden or w.router.shape[1] != cfg.n_experts:
            raise ValueError(f"weights{tag} hold {w.n_held} experts of hidden {w.hidden} and a router over "
                             f"{w.router.shape[1]} experts; cfg needs {cfg.n_groups} (L = {cfg.n_local_experts}"
                             f"{' + the shared expert' if cfg.fused_shared_expert else ''}), hidden {cfg.hidden}, "
                             f"E = {cfg.n_experts}")
        _check_array(x, f"x{tag}", dev, (BF16, _F32), 2, f"[N, {cfg.hidden}]")
        if x.shape[1] != cfg.hidden:
            raise ValueError(f"x{tag} must be a cupy [N, {cfg.hidden}] array (cfg.hidden={cfg.hidden}), got shape "
                             f"{x.shape}")
        if x.shape[0] > cfg.max_tokens_per_rank:
            raise ValueError(f"x{tag} has {x.shape[0]} tokens, more than cfg.max_tokens_per_rank="
                             f"{cfg.max_tokens_per_rank}: split the batch")


@torch_aware
def moe_forward(buf, x, weights, *, global_scale: float = 1.0, timings: dict | None = None):
    """One MoE layer on every local rank: route, dispatch, expert MLPs (SwiGLU), combine (+ shared expert).

    Args:
        buf: the group's :class:`cuep.Buffer`; ``buf.cfg`` sets the dispatch format (the experts dequantize its
            rows), the combine dtype and the fused shared expert (not ``skip_a2a``).
        x: per local rank, [N, H] bfloat16 (or float32) cupy array on the rank's GPU (N <= T, may differ, may be 0);
            a bare array when the process drives one rank.
        weights: per local rank, its :class:`MoEWeights` on that GPU (``init_weights(cfg, I, seed, devices)``).
        global_scale: nvfp4's global scale g for dispatch and dequantize.
        timings: optional dict, filled with CUDA-event milliseconds per phase (``PHASES``: router, dispatch,
            experts, combine; the longest over this process's devices) and ``total``. Experts include the host
            read of the group sizes and one GEMM launch per group; asking for timings synchronises at the end.

    Returns:
        per local rank, [N, H] in ``cfg.combine_dtype`` (bfloat16 by default): ``sum_k w[t, k] * expert_k(x[t])``
        (+ ``shared(x[t])``), a fresh array (not the buffer's reused combine output).
    """
    import cupy
    bare = not isinstance(x, (list, tuple))
    xs = [x] if bare else list(x)
    ws = [weights] if isinstance(weights, MoEWeights) else list(weights) if isinstance(weights, (list, tuple)) \
        else [weights]
    _check_forward_args(buf, xs, ws)
    cfg = buf.cfg
    devices = buf.group.devices
    cdt = BF16 if cfg.combine_dtype == "bfloat16" else _F32
    timer = _PhaseTimer(devices, timings is not None)

    timer.mark()
    routed = []
    for xi, wi, dev in zip(xs, ws, devices):
        with cupy.cuda.Device(dev):
            routed.append(route(xi, wi.router, cfg.top_k))
    timer.mark()
    # Weights ride along with dispatch, so combine reduces each token over a rank's experts before sending it back.
    d = dispatch(buf, xs, [r[0] for r in routed], [r[1] for r in routed], global_scale=global_scale)
    timer.mark()
    ys = []
    for di, wi, dev in zip(d, ws, devices):
        with cupy.cuda.Device(dev):
            ys.append(_expert_outputs(di, wi, cfg, global_scale, cupy.empty((cfg.capacity, cfg.hidden), cdt)))
    timer.mark()
    combined = combine(buf, ys, d)
    timer.mark()
    out = []
    for o, dev in zip(combined, devices):
        with cupy.cuda.Device(dev):
            out.append(o.copy())
    if timings is not None:
        timings.update(timer.elapsed_ms(PHASES))
    return out[0] if bare else out


# ---- the dense reference ------------------------------------------------------------------------------------------
def _mlp_f32(x: np.ndarray, w_gate_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """float32 SwiGLU expert: (silu(x @ W_gate) * (x @ W_up)) @ W_down."""
    h = x @ w_gate_up.astype(np.float32)
    inter = h.shape[1] // 2
    gate, up = h[:, :inter], h[:, inter:]
    with np.errstate(over="ignore"):
        act = gate / (np.float32(1) + np.exp(-gate)) * up
    return act @ w_down.astype(np.float32)


def _wire_values(x: np.ndarray, cfg: EPConfig, global_scale: float) -> np.ndarray:
    """float32 [N, H]: what the experts see of ``x`` after the dispatch format's quantization."""
    if x.shape[0] == 0:
        return np.zeros(x.shape, np.float32)
    payload, scales = reference.quantize(x, cfg.fmt.name, global_scale)
    return reference.dequantize(payload, scales, cfg.fmt.name, cfg.hidden, global_scale)


def moe_reference(x, weights, cfg: EPConfig, *, global_scale: float = 1.0) -> list[np.ndarray]:
    """The same layer, dense, in NumPy: every expert on every token, masked by the routing (float32 math).

    The experts see the tokens after the dispatch format's quantization (``cuep.reference.quantize`` then
    ``dequantize``, bit for bit what the GPU experts dequantize), so the comparison with :func:`moe_forward`
    measures its bf16 GEMMs and roundings only.

    Args:
        x: list of R NumPy [N_r, H] bfloat16 or float32 arrays, one per rank (all ranks of the group).
        weights: list of R :class:`MoEWeights` with NumPy arrays (``[w.to_numpy() for w in ...]``).
        cfg: the group's :class:`cuep.EPConfig`.
        global_scale: nvfp4's global scale g.

    Returns:
        list of R float32 [N_r, H]: ``sum_e gate[t, e] * expert_e(q(x[t]))`` (+ ``shared_r(q(x[t]))``), where gate
        holds the renormalised top-k softmax weights of :func:`route` and 0 elsewhere.
    """
    if not isinstance(cfg, EPConfig):
        raise TypeError(f"cfg must be an EPConfig, got {type(cfg).__name__}")
    R, L, E, K, H = cfg.n_ranks, cfg.n_local_experts, cfg.n_experts, cfg.top_k, cfg.hidden
    for name, v in (("x", x), ("weights", weights)):
        if not isinstance(v, (list, tuple)) or len(v) != R:
            raise ValueError(f"{name} must be a list of {R} entries, one per rank (cfg.n_ranks)")
    for r, w in enumerate(weights):
        if not isinstance(w, MoEWeights) or not isinstance(w.w_gate_up, np.ndarray):
            raise TypeError(f"weights[{r}] must be a MoEWeights of NumPy arrays (use w.to_numpy())")
        if w.n_held != cfg.n_groups or w.hidden != H or w.router.shape[1] != E:
            raise ValueError(f"weights[{r}] hold {w.n_held} experts of hidden {w.hidden}, router over "
                             f"{w.router.shape[1]}; cfg needs {cfg.n_groups}, {H}, {E}")
    outs = []
    for r in range(R):
        xr = np.asarray(x[r])
        if xr.ndim != 2 or xr.shape[1] != H:
            raise ValueError(f"x[{r}] has shape {xr.shape}; expected [N, hidden={H}]")
        n = xr.shape[0]
        ids, topk_weights = route(xr, weights[r].router, K)
        gates = np.zeros((n, E), np.float32)
        np.put_along_axis(gates, ids, topk_weights, axis=1)
        xq = _wire_values(xr, cfg, global_scale)
        out = np.zeros((n, H), np.float32)
        for e in range(E):
            owner, local = divmod(e, L)
            out += gates[:, e:e + 1] * _mlp_f32(xq, weights[owner].w_gate_up[local], weights[owner].w_down[local])
        if cfg.fused_shared_expert:
            out += _mlp_f32(xq, weights[r].w_gate_up[L], weights[r].w_down[L])
        outs.append(out)
    return outs

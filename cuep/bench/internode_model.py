"""Network bytes and time of one multi-node dispatch or combine round, on paper (pure NumPy: no GPU, no NIC).

``python -m cuep.bench.internode_model`` prints the tables of ``docs/internode.md``.

The group: G GPUs per node, M nodes, R = G x M ranks, E experts split evenly and contiguously (expert e on rank
e // (E / R), so on node e // (E / M)), K distinct experts per token, H values per row, N tokens per rank. Each GPU
has its own NIC (rail-aligned); only bytes that leave the rank's node count, completion signals are left out.

* **dedup** (cuep's large rounds): a token crosses the network once per *other* node holding one of its experts,
  to the rank with its own local GPU index there (its forwarder), which hands it on over NVLink. Row = the
  format's payload + scales; each token also sends a header of K int32 ids + K float32 weights (8K bytes) to
  every other node (``header_every_node=False``: only to the nodes it is bound for). Combine: the forwarder sums
  its node's partial sums and returns one row per (token, other node) in the combine dtype.
* **no dedup** (cuep's small rounds, which go direct; NCCL all-to-all; DeepEP low-latency): row + header once
  per (token, destination rank on another node); combine returns one row per such pair.

Routing (node-symmetric, so every rank sends the same expected bytes): ``"uniform"``, K distinct experts uniformly
at random among E; ``"limited:n"`` (DeepSeek-V3 style), the token picks min(n, M) nodes uniformly, then K distinct
experts uniformly among the experts of those nodes. Expectations are exact (hypergeometric):
P(a given node of the pool is missed) = C(P - E/M, K) / C(P, K), P = the pool's experts; likewise a rank with E/R.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import numpy as np

from ..config import COMBINE_DTYPES
from ..formats import get_format

PHASES = ("dispatch", "combine")
HEADER_BYTES_PER_CHOICE = 8   # int32 expert id + float32 weight per choice
DEFAULT_NIC_GBPS = 50.0       # a 400 Gb/s NIC per GPU
NVLINK_GBPS = {"H800": 160.0,  # DeepEP's stated NVLink figure for H800
               "H200": 356.0}  # cuep's measured all-pairs ceiling out of one GPU (BENCHMARKS.md, 4 x H200)


@dataclass(frozen=True)
class Shape:
    """The sizes the model needs; any object with these attributes (an :class:`cuep.EPConfig`) serves too."""

    hidden: int
    top_k: int
    n_experts: int
    n_gpus_per_node: int
    n_nodes: int


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return int(value)


def routing_nodes(routing: str, n_nodes: int) -> int:
    """Nodes a token draws its experts from: ``n_nodes`` for ``"uniform"``, min(n, n_nodes) for ``"limited:n"``."""
    n_nodes = _positive("n_nodes", n_nodes)
    if routing == "uniform":
        return n_nodes
    if isinstance(routing, str) and routing.startswith("limited:"):
        try:
            n = int(routing[len("limited:"):])
        except ValueError:
            n = 0
        if n >= 1:
            return min(n, n_nodes)
    raise ValueError(f"routing={routing!r} must be 'uniform' or 'limited:<n>' with n >= 1 nodes per token")


def _pool(n_nodes: int, gpus_per_node: int, n_experts: int, top_k: int, routing: str) -> tuple[int, int, int]:
    """(nodes in a token's pool, experts per node, experts per rank), after checking the group."""
    M, G = _positive("n_nodes", n_nodes), _positive("gpus_per_node", gpus_per_node)
    E, K = _positive("n_experts", n_experts), _positive("top_k", top_k)
    if E % (M * G):
        raise ValueError(f"n_experts={E} must be a multiple of the ranks {M * G} (n_nodes x gpus_per_node)")
    n_pool = routing_nodes(routing, M)
    if K > n_pool * (E // M):
        raise ValueError(f"top_k={K} must be <= {n_pool * (E // M)}, the experts of the {n_pool} nodes routing="
                         f"{routing!r} lets a token use")
    return n_pool, E // M, E // (M * G)


def _p_miss(pool: int, group: int, k: int) -> float:
    """P(none of k distinct uniform draws from ``pool`` items falls in a given ``group`` of them)."""
    return math.comb(pool - group, k) / math.comb(pool, k)


def expected_nodes_per_token(n_nodes: int, gpus_per_node: int, n_experts: int, top_k: int,
                             routing: str = "uniform", *, remote: bool = False) -> float:
    """Expected distinct nodes holding at least one of a token's experts (``remote``: other than its own).

    By symmetry the source's node is any one of the M with equal chance, so remote = total x (M - 1) / M.
    """
    n_pool, per_node, _ = _pool(n_nodes, gpus_per_node, n_experts, top_k, routing)
    total = n_pool * (1.0 - _p_miss(n_pool * per_node, per_node, top_k))
    return total * (n_nodes - 1) / n_nodes if remote else total


def expected_ranks_per_token(n_nodes: int, gpus_per_node: int, n_experts: int, top_k: int,
                             routing: str = "uniform", *, remote: bool = False) -> float:
    """Expected distinct ranks holding at least one of a token's experts (``remote``: on other nodes)."""
    n_pool, per_node, per_rank = _pool(n_nodes, gpus_per_node, n_experts, top_k, routing)
    total = n_pool * gpus_per_node * (1.0 - _p_miss(n_pool * per_node, per_rank, top_k))
    return total * (n_nodes - 1) / n_nodes if remote else total


def sample_routing(rng: np.random.Generator, n_tokens: int, n_nodes: int, gpus_per_node: int, n_experts: int,
                   top_k: int, routing: str = "uniform") -> np.ndarray:
    """int64 [n_tokens, K]: K distinct experts per token drawn as ``routing`` says (for Monte-Carlo checks)."""
    n_pool, per_node, _ = _pool(n_nodes, gpus_per_node, n_experts, top_k, routing)
    N = _positive("n_tokens", n_tokens)
    nodes = np.argsort(rng.random((N, n_nodes)), axis=1)[:, :n_pool]            # the token's pool of nodes
    pick = np.argsort(rng.random((N, n_pool * per_node)), axis=1)[:, :top_k]    # K distinct places in the pool
    return np.take_along_axis(nodes, pick // per_node, axis=1) * per_node + pick % per_node


def row_bytes(fmt: str, hidden: int) -> int:
    """Bytes of one dispatched row on the wire: the format's payload plus its scales."""
    f = get_format(fmt, "fmt")
    return f.payload_bytes(hidden) + f.scale_bytes(hidden)


def header_bytes(top_k: int) -> int:
    """Bytes of a token's routing header: K int32 expert ids + K float32 weights."""
    return HEADER_BYTES_PER_CHOICE * top_k


def _message_bytes(shape, fmt: str, phase: str, combine_dtype: str) -> int:
    if phase == "dispatch":
        return row_bytes(fmt, shape.hidden)
    if phase == "combine":
        if combine_dtype not in COMBINE_DTYPES:
            raise ValueError(f"combine_dtype={combine_dtype!r} must be one of {sorted(COMBINE_DTYPES)}")
        return shape.hidden * COMBINE_DTYPES[combine_dtype]
    raise ValueError(f"phase={phase!r} must be one of {PHASES}")


def _per_token(shape, routing: str) -> tuple[float, float, float]:
    """(nodes, remote nodes, remote ranks) per token."""
    args = (shape.n_nodes, shape.n_gpus_per_node, shape.n_experts, shape.top_k, routing)
    return (expected_nodes_per_token(*args), expected_nodes_per_token(*args, remote=True),
            expected_ranks_per_token(*args, remote=True))


def _tokens(n_tokens) -> int:
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or n_tokens < 0:
        raise ValueError(f"n_tokens={n_tokens!r} must be an int >= 0")
    return int(n_tokens)


def network_bytes_per_rank(shape, n_tokens: int, fmt: str = "bf16", routing: str = "uniform", dedup: bool = True,
                           phase: str = "dispatch", *, combine_dtype: str = "bfloat16",
                           header_every_node: bool = True) -> float:
    """Expected bytes one rank sends over its NIC in one round.

    Args:
        shape: hidden, top_k, n_experts, n_gpus_per_node, n_nodes (a :class:`Shape` or an ``EPConfig``).
        n_tokens: N, tokens the rank dispatches (combine: the same round's tokens coming back).
        fmt: dispatch wire format (``"bf16" | "fp8" | "nvfp4" | "mxfp4"``); unused by combine.
        routing: ``"uniform" | "limited:<n>"``.
        dedup: one row per (token, other node) through a forwarder; else one per (token, remote rank).
        phase: ``"dispatch" | "combine"``.
        combine_dtype: ``"bfloat16" | "float32"``, the partial sums' dtype.
        header_every_node: dedup dispatch sends each token's 8K-byte header to all M - 1 other nodes (the design);
            False: only to the nodes the token is bound for.
    Returns:
        bytes (float: an expectation).
    """
    N = _tokens(n_tokens)
    m = _message_bytes(shape, fmt, phase, combine_dtype)
    _, nodes_r, ranks_r = _per_token(shape, routing)
    hdr = header_bytes(shape.top_k) if phase == "dispatch" else 0
    if dedup:
        hdr_copies = (shape.n_nodes - 1) if header_every_node else nodes_r
        return N * (nodes_r * m + hdr_copies * hdr)
    return N * ranks_r * (m + hdr)


def nvlink_bytes_per_rank(shape, n_tokens: int, fmt: str = "bf16", routing: str = "uniform", dedup: bool = True,
                          phase: str = "dispatch", *, combine_dtype: str = "bfloat16") -> float:
    """Expected row bytes one rank sends (= receives, by symmetry) over NVLink in one round; headers left out.

    A rank receives N x (ranks per token) rows in all. With dedup only its own rows and those its M - 1 same-index
    peers send it over the network (as their forwarder, when it holds an expert itself) skip NVLink: a share 1 / G.
    Without dedup only rows from the G - 1 other ranks of its node use NVLink: a share (G - 1) / R.
    """
    N = _tokens(n_tokens)
    m = _message_bytes(shape, fmt, phase, combine_dtype)
    args = (shape.n_nodes, shape.n_gpus_per_node, shape.n_experts, shape.top_k, routing)
    ranks = expected_ranks_per_token(*args)
    G, R = shape.n_gpus_per_node, shape.n_gpus_per_node * shape.n_nodes
    share = (1 - 1 / G) if dedup else (G - 1) / R
    return N * ranks * share * m


def deepep_counted_bytes(shape, n_tokens: int, fmt: str = "bf16", routing: str = "uniform",
                         phase: str = "dispatch", *, combine_dtype: str = "bfloat16") -> float:
    """The bytes DeepEP's normal-kernel tests divide by time for "RDMA bandwidth": one row per (token, node
    holding one of its experts), the token's own node included; fp8 rows with their scales, combine rows bf16."""
    N = _tokens(n_tokens)
    nodes, _, _ = _per_token(shape, routing)
    return N * nodes * _message_bytes(shape, fmt, phase, combine_dtype)


def remote_a2a_bytes(shape, n_tokens: int, fmt: str = "bf16", routing: str = "uniform",
                     phase: str = "dispatch", *, combine_dtype: str = "bfloat16") -> float:
    """Logical all-to-all bytes that cross nodes: one row per (token, remote rank holding one of its experts),
    headers left out (what an all-to-all without dedup must put on the wire)."""
    N = _tokens(n_tokens)
    _, _, ranks_r = _per_token(shape, routing)
    return N * ranks_r * _message_bytes(shape, fmt, phase, combine_dtype)


def round_time_us(nbytes: float, nic_GBps: float = DEFAULT_NIC_GBPS) -> float:
    """Microseconds to move ``nbytes`` at ``nic_GBps`` (1 GB = 1e9 bytes), no latency or overhead."""
    if not nic_GBps > 0:
        raise ValueError(f"nic_GBps={nic_GBps!r} must be > 0")
    return nbytes / (nic_GBps * 1e3)


def dedup_crossover_tokens(shape, fmt: str = "bf16", routing: str = "uniform", phase: str = "dispatch", *,
                           extra_hop_us: float = 5.0, nic_GBps: float = DEFAULT_NIC_GBPS,
                           combine_dtype: str = "bfloat16", header_every_node: bool = True) -> float:
    """Tokens per rank above which dedup's round is shorter than the direct one, if dedup's second (NVLink) hop
    adds ``extra_hop_us`` of latency: extra_hop_us / (bytes per token saved / nic_GBps). ``inf`` if it saves none."""
    if not extra_hop_us >= 0:
        raise ValueError(f"extra_hop_us={extra_hop_us!r} must be >= 0")
    kw = dict(combine_dtype=combine_dtype)
    direct = network_bytes_per_rank(shape, 1, fmt, routing, False, phase, **kw)
    saved = direct - network_bytes_per_rank(shape, 1, fmt, routing, True, phase, **kw,
                                            header_every_node=header_every_node)
    return extra_hop_us / round_time_us(saved, nic_GBps) if saved > 0 else math.inf


def table(n_nodes: tuple[int, ...] = (2, 4, 8), gpus_per_node: int = 8, n_tokens: int = 4096, hidden: int = 7168,
          top_k: int = 8, n_experts: int = 256, formats: tuple[str, ...] = ("bf16", "fp8"),
          routings: tuple[str, ...] = ("uniform", "limited:4"), nic_GBps: float = DEFAULT_NIC_GBPS,
          combine_dtype: str = "bfloat16", header_every_node: bool = True, extra_hop_us: float = 5.0) -> list[dict]:
    """One row per (nodes, routing, phase, format, dedup): dispatch in each of ``formats``, combine in
    ``combine_dtype`` (its ``format`` is that dtype's name).

    Keys: nodes, ep (ranks), routing, phase, format, dedup, nodes_per_token, remote_nodes_per_token,
    remote_ranks_per_token, network_MB (per rank per round, 1 MB = 1e6 B), time_us (at ``nic_GBps``),
    deepep_GBps (:func:`deepep_counted_bytes` / time), a2a_GBps (:func:`remote_a2a_bytes` / time), nvlink_MB
    (:func:`nvlink_bytes_per_rank`), crossover_tokens (:func:`dedup_crossover_tokens` with ``extra_hop_us``).
    """
    rows = []
    for M in n_nodes:
        shape = Shape(hidden, top_k, n_experts, gpus_per_node, M)
        for routing in routings:
            nodes, nodes_r, ranks_r = _per_token(shape, routing)
            cases = [("dispatch", f) for f in formats] + [("combine", combine_dtype)]
            for phase, fmt in cases:
                kw = dict(combine_dtype=combine_dtype)
                counted = deepep_counted_bytes(shape, n_tokens, fmt, routing, phase, **kw)
                cross = dedup_crossover_tokens(shape, fmt, routing, phase, extra_hop_us=extra_hop_us,
                                               nic_GBps=nic_GBps, header_every_node=header_every_node, **kw)
                a2a = remote_a2a_bytes(shape, n_tokens, fmt, routing, phase, **kw)
                for dedup in (True, False):
                    b = network_bytes_per_rank(shape, n_tokens, fmt, routing, dedup, phase, **kw,
                                               header_every_node=header_every_node)
                    t = round_time_us(b, nic_GBps)
                    rows.append(dict(
                        nodes=M, ep=M * gpus_per_node, routing=routing, phase=phase,
                        format="bf16" if fmt == "bfloat16" else ("fp32" if fmt == "float32" else fmt),
                        dedup=dedup, nodes_per_token=nodes, remote_nodes_per_token=nodes_r,
                        remote_ranks_per_token=ranks_r, network_MB=b / 1e6, time_us=t,
                        deepep_GBps=counted / (t * 1e3) if t else 0.0, a2a_GBps=a2a / (t * 1e3) if t else 0.0,
                        nvlink_MB=nvlink_bytes_per_rank(shape, n_tokens, fmt, routing, dedup, phase, **kw) / 1e6,
                        crossover_tokens=cross))
    return rows


# ---- markdown --------------------------------------------------------------------------------------------------
def _merged(rows: list[dict]) -> list[tuple[str, dict, dict]]:
    """(routing label, dedup row, no-dedup row) per (nodes, phase, format), routings that give the same numbers
    (``limited:n`` with n >= nodes is uniform) merged into one label."""
    out: dict[tuple, tuple[list[str], dict, dict]] = {}
    for r in rows:
        if not r["dedup"]:
            continue
        twin = next(x for x in rows if not x["dedup"] and all(x[k] == r[k] for k in ("nodes", "routing", "phase",
                                                                                     "format")))
        key = (r["nodes"], r["phase"], r["format"], routing_nodes(r["routing"], r["nodes"]))
        if key in out:
            out[key][0].append(r["routing"])
        else:
            out[key] = ([r["routing"]], r, twin)
    return [(", ".join(names), d, n) for names, d, n in out.values()]


def markdown_large(rows: list[dict], phase: str) -> str:
    """The dispatch or combine table of large rounds (dedup beside no dedup)."""
    head = ("| EP | routing | format | remote nodes / ranks | MB, dedup / none "
            "| us, dedup / none | DeepEP-count GB/s, dedup / none | a2a GB/s, dedup |")
    lines = [head, "| " + " | ".join(["---"] * 8) + " |"]
    for label, d, n in _merged([r for r in rows if r["phase"] == phase]):
        lines.append(f"| {d['nodes']} x {d['ep'] // d['nodes']} | {label} | {d['format']} | "
                     f"{d['remote_nodes_per_token']:.2f} / {d['remote_ranks_per_token']:.2f} | "
                     f"{d['network_MB']:.1f} / {n['network_MB']:.1f} | "
                     f"{d['time_us']:.0f} / {n['time_us']:.0f} | {d['deepep_GBps']:.1f} / {n['deepep_GBps']:.1f} | "
                     f"{d['a2a_GBps']:.1f} |")
    return "\n".join(lines)


def markdown_nvlink(rows: list[dict], nvlink: dict[str, float] = NVLINK_GBPS) -> str:
    """A dedup round's NVLink bytes against its network bytes, the time at each NVLink bandwidth, and the ceiling
    of DeepEP's count: its bytes over the longer of the NIC's and NVLink's times."""
    names = list(nvlink)
    at = " / ".join(f"{nvlink[k]:.0f}" for k in names)
    lines = [f"| EP | routing | NVLink MB | x network bytes | NVLink us at {at} GB/s | NIC us "
             f"| DeepEP-count ceiling GB/s, {' / '.join(names)} |", "| " + " | ".join(["---"] * 7) + " |"]
    for label, d, _ in _merged(rows):
        counted = d["deepep_GBps"] * d["time_us"] * 1e3              # bytes
        nvl_us = [d["nvlink_MB"] * 1e3 / nvlink[k] for k in names]
        ceil = [counted / (max(d["time_us"], t) * 1e3) for t in nvl_us]
        lines.append(f"| {d['nodes']} x {d['ep'] // d['nodes']} | {label} | {d['nvlink_MB']:.1f} | "
                     f"{d['nvlink_MB'] / d['network_MB']:.2f} | " + " / ".join(f"{t:.0f}" for t in nvl_us)
                     + f" | {d['time_us']:.0f} | " + " / ".join(f"{c:.1f}" for c in ceil) + " |")
    return "\n".join(lines)


def markdown_small(rows: list[dict]) -> str:
    """Small rounds: the direct path (no dedup) beside what dedup would send."""
    lines = ["| EP | routing | op | KB, direct / dedup | us, direct / dedup | dedup ahead above N = |",
             "| --- | --- | --- | --- | --- | --- |"]
    for label, d, n in _merged(rows):
        lines.append(f"| {d['nodes']} x {d['ep'] // d['nodes']} | {label} | {d['phase']} {d['format']} | "
                     f"{n['network_MB'] * 1e3:.0f} / {d['network_MB'] * 1e3:.0f} | "
                     f"{n['time_us']:.1f} / {d['time_us']:.1f} | {d['crossover_tokens']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Print the model's tables as markdown."""
    p = argparse.ArgumentParser(prog="python -m cuep.bench.internode_model", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="N of the large rounds (default 4096)")
    p.add_argument("--small-tokens", type=int, default=128, help="N of the small rounds (default 128)")
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8], help="node counts, 8 GPUs each")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8"], help="dispatch formats (the last one is "
                   "used in the NVLink and small-round tables)")
    p.add_argument("--routings", nargs="+", default=["uniform", "limited:4"])
    p.add_argument("--nic-gbps", type=float, default=DEFAULT_NIC_GBPS, help="GB/s per GPU's NIC (default 50)")
    p.add_argument("--hop-us", type=float, default=5.0, help="latency of dedup's second hop, for the crossover")
    p.add_argument("--combine-dtype", default="bfloat16", choices=sorted(COMBINE_DTYPES))
    a = p.parse_args(argv)
    kw = dict(n_nodes=tuple(a.nodes), hidden=a.hidden, top_k=a.top_k, n_experts=a.experts,
              formats=tuple(a.formats), routings=tuple(a.routings), nic_GBps=a.nic_gbps,
              combine_dtype=a.combine_dtype, extra_hop_us=a.hop_us)
    large, small = table(n_tokens=a.tokens, **kw), table(n_tokens=a.small_tokens, **kw)
    shape = f"H = {a.hidden}, K = {a.top_k}, E = {a.experts}, 8 GPUs per node, {a.nic_gbps:g} GB/s per NIC"
    print(f"Dispatch, N = {a.tokens}, {shape}:\n\n{markdown_large(large, 'dispatch')}\n")
    print(f"Combine ({a.combine_dtype}), same shape:\n\n{markdown_large(large, 'combine')}\n")
    nvl = [r for r in large if r["phase"] == "dispatch" and r["format"] == a.formats[-1]]
    print(f"NVLink side of a dedup dispatch ({a.formats[-1]}), N = {a.tokens} (combine: the same ratios):\n\n"
          f"{markdown_nvlink(nvl)}\n")
    print(f"Small rounds, N = {a.small_tokens} (bandwidth time only; crossover with a {a.hop_us:g} us second "
          f"hop):\n")
    print(markdown_small([r for r in small if r["phase"] == "combine" or r["format"] == a.formats[-1]]))


if __name__ == "__main__":
    main()

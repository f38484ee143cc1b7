"""``EPConfig``: the sizes of one expert-parallel group, validated and derived in one place."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from .formats import ALIGN, SCALE_TILE_BYTES, SCALE_TILE_ROWS, Format, MessageLayout, align_up, ceil_div, \
    check_hidden, get_format

MAX_GPUS_PER_NODE = 8
SMALL_BATCH_DEFAULT = 256     # default small_batch_tokens (capped at max_tokens_per_rank): the measured crossover
SMALL_BATCH_MAX_CHOICES = 8192  # small_batch_tokens x top_k: block 0's bookkeeping in shared memory
SMALL_BATCH_MAX_EXPERTS = 1024  # n_experts: a token mask per expert in shared memory
SMALL_BATCH_MAX_MASK_BYTES = 65536  # n_experts x ceil(small_batch_tokens / 32) x 4: those token masks
COMBINE_DTYPES = {"bfloat16": 2, "float32": 4}
NOTIFY_RANGES = 256  # kNotifyRanges (ep/params.cuh): a large dispatch round numbers messages in this many token ranges
LOCAL_HIST_STRIDE = 32  # kLocalHistStride (ep/state.cuh): ints between two experts' counts of a one-rank histogram
COMBINE_POLL_TOKENS = 256  # tokens 0..255 of a bf16 partial-sum round in parity slots: the receiver polls the data


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")


@dataclass(frozen=True)
class EPConfig:
    """Sizes and formats of one expert-parallel group; every derived size lives here.

    Args:
        hidden: H, values per token row; a multiple of 8 (bf16), 128 (fp8) or 32 (nvfp4, mxfp4): rows of whole
            16-byte vectors and scale blocks.
        top_k: K, experts per token.
        n_experts: E, routed experts in the whole group; split evenly and contiguously over the ranks
            (expert ``e`` lives on rank ``e // n_local_experts`` as local expert ``e % n_local_experts``).
        max_tokens_per_rank: T, the most tokens any rank dispatches in one round.
        n_gpus_per_node: GPUs per node taking part (1..8).
        n_nodes: nodes (only 1 has a transport today; the reference simulates more).
        dispatch_format: ``"bf16" | "fp8" | "nvfp4" | "mxfp4"``, the wire and output format of dispatch.
        combine_dtype: ``"bfloat16" | "float32"``, the dtype of expert outputs and of the combined result.
        fused_shared_expert: dispatch puts this rank's own tokens as group 0 (the shared expert) ahead of the
            routed experts, and combine adds that group's output with weight 1.
        skip_a2a: every rank holds the same tokens; dispatch sends only to this rank's experts and combine
            returns the partial sum over them (for a later all-reduce).
        small_batch_tokens: a dispatch round in which a rank sends at most this many tokens uses the
            low-latency (decode) protocol for them: the tokens go to a staging area at each destination at once,
            without first waiting for every rank's histogram, and the receiver places them. Default
            min(max_tokens_per_rank, 256) (0 when n_experts > 1024; on 2 x H200 the staged protocol is faster
            up to N = 256 and level with the direct one at N = 512); 0 turns it off. Costs
            2 x sources x (small_batch_tokens x stage_record_bytes + 8 x small_book_len) of symmetric memory per
            rank.
        allreduce_world_size: A, the ranks of the all-reduce that follows a ``skip_a2a`` combine with a
            ``fused_shared_expert``: groups of A consecutive ranks (group g = ranks g*A .. g*A + A - 1). With
            A > 1 each rank of a group takes one share of the shared expert's tokens (:meth:`shared_expert_share`)
            instead of all of them, so the all-reduce adds each token's shared expert once, not A times. Default
            1 (every rank takes all its tokens). A > 1 needs ``skip_a2a`` and ``fused_shared_expert``, and
            n_ranks must be a multiple of A.

    Raises:
        ValueError: naming the argument and the rule it breaks.
    """

    hidden: int
    top_k: int
    n_experts: int
    max_tokens_per_rank: int
    n_gpus_per_node: int
    n_nodes: int = 1
    dispatch_format: str = "bf16"
    combine_dtype: str = "bfloat16"
    fused_shared_expert: bool = False
    skip_a2a: bool = False
    small_batch_tokens: int | None = None
    allreduce_world_size: int = 1
    fmt: Format = field(init=False, repr=False, compare=False)
    message: MessageLayout = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("hidden", "top_k", "n_experts", "max_tokens_per_rank", "n_gpus_per_node", "n_nodes"):
            _positive_int(name, getattr(self, name))
        if self.n_gpus_per_node > MAX_GPUS_PER_NODE:
            raise ValueError(f"n_gpus_per_node={self.n_gpus_per_node} exceeds {MAX_GPUS_PER_NODE}, the most GPUs "
                             f"one node's NVLink domain holds here")
        fmt = get_format(self.dispatch_format, "dispatch_format")
        check_hidden(fmt, self.hidden)
        if fmt.payload_bytes(self.hidden) % 16:  # (nvfp4 at an odd multiple of 16: a misaligned address on the GPU)
            raise ValueError(f"hidden={self.hidden} must be a multiple of 32 for dispatch_format={fmt.name!r}: a "
                             f"dispatched row ({fmt.payload_bytes(self.hidden)} bytes) is stored in 16-byte vectors")
        if self.n_experts % self.n_ranks:
            raise ValueError(f"n_experts={self.n_experts} must be a multiple of the number of ranks "
                             f"{self.n_ranks} (n_gpus_per_node x n_nodes) so experts split evenly")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be <= n_experts={self.n_experts}")
        if self.top_k > 0xFFFF or self.n_experts > 0xFFFF:
            raise ValueError("top_k and n_experts must fit in uint16 (message expert ids are uint16)")
        if self.combine_dtype not in COMBINE_DTYPES:
            raise ValueError(f"combine_dtype={self.combine_dtype!r} must be one of {sorted(COMBINE_DTYPES)}")
        if self.max_tokens_per_rank >= 2**31 // max(1, self.n_ranks * self.top_k):
            raise ValueError(f"max_tokens_per_rank={self.max_tokens_per_rank} is too large: rows must fit int32")
        self._check_allreduce_world_size()
        object.__setattr__(self, "fmt", fmt)
        object.__setattr__(self, "small_batch_tokens", self._small_batch_tokens())
        object.__setattr__(self, "message", MessageLayout.make(fmt, self.hidden, self.top_k))

    def _check_allreduce_world_size(self) -> None:
        A = self.allreduce_world_size
        _positive_int("allreduce_world_size", A)
        if A > 1 and not (self.skip_a2a and self.fused_shared_expert):
            raise ValueError(f"allreduce_world_size={A} needs skip_a2a=True and fused_shared_expert=True (got "
                             f"skip_a2a={self.skip_a2a}, fused_shared_expert={self.fused_shared_expert}): it splits "
                             f"the shared expert's tokens over the ranks of the all-reduce after a skip_a2a combine")
        if self.n_ranks % A:
            raise ValueError(f"allreduce_world_size={A} must divide the number of ranks {self.n_ranks} "
                             f"(n_gpus_per_node x n_nodes): all-reduce groups are A consecutive ranks")

    def _small_batch_tokens(self) -> int:
        """The resolved ``small_batch_tokens`` (default, or the given value after its checks)."""
        v = self.small_batch_tokens
        if v is None:
            if self.n_experts > SMALL_BATCH_MAX_EXPERTS:
                return 0
            return min(self.max_tokens_per_rank, SMALL_BATCH_DEFAULT, SMALL_BATCH_MAX_CHOICES // self.top_k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"small_batch_tokens={v!r} must be an int >= 0 (0 turns the decode protocol off)")
        if v > self.max_tokens_per_rank:
            raise ValueError(f"small_batch_tokens={v} must be <= max_tokens_per_rank={self.max_tokens_per_rank}")
        if v and v * self.top_k > SMALL_BATCH_MAX_CHOICES:
            raise ValueError(f"small_batch_tokens={v} x top_k={self.top_k} must be <= {SMALL_BATCH_MAX_CHOICES} "
                             f"(block 0 keeps every choice's bookkeeping in shared memory)")
        if v and self.n_experts > SMALL_BATCH_MAX_EXPERTS:
            raise ValueError(f"small_batch_tokens={v} needs n_experts <= {SMALL_BATCH_MAX_EXPERTS} (got "
                             f"{self.n_experts}); pass small_batch_tokens=0")
        if v and self.n_experts * -(-v // 32) * 4 > SMALL_BATCH_MAX_MASK_BYTES:
            most = SMALL_BATCH_MAX_MASK_BYTES // (4 * self.n_experts) * 32
            raise ValueError(f"small_batch_tokens={v} with n_experts={self.n_experts} must be <= {most} (block 0 "
                             f"keeps a token mask per expert in {SMALL_BATCH_MAX_MASK_BYTES} bytes of shared memory)")
        return v

    # ---- the group -----------------------------------------------------------------------------------------
    @property
    def n_ranks(self) -> int:
        """R = n_gpus_per_node x n_nodes."""
        return self.n_gpus_per_node * self.n_nodes

    @property
    def n_local_experts(self) -> int:
        """L = E / R routed experts per rank."""
        return self.n_experts // self.n_ranks

    @property
    def n_groups(self) -> int:
        """Expert groups in a dispatch output: L, plus one for the fused shared expert."""
        return self.n_local_experts + int(self.fused_shared_expert)

    @property
    def shared_expert_id(self) -> int:
        """``expert_ids`` value of the fused shared expert group: L (stack its weights after the routed ones)."""
        return self.n_local_experts

    def shared_expert_share(self, rank: int, n_tokens: int) -> tuple[int, int]:
        """The tokens ``[lo, hi)`` of the fused shared expert that ``rank`` takes, of its ``n_tokens``.

        With ``allreduce_world_size`` A > 1 the rank at position p = rank % A of its all-reduce group takes
        lo = (p * N) // A, hi = ((p + 1) * N) // A: the group's shares tile [0, N) in order, sizes differing by at
        most one (empty ones when N < A). Dispatch puts those tokens, in order, in group 0; combine adds row
        t - lo of group 0 to token t only for t in [lo, hi). With A = 1: (0, N).

        Args:
            rank: the rank, in [0, n_ranks).
            n_tokens: N, the tokens the rank holds in this round, in [0, max_tokens_per_rank].
        Returns:
            ``(lo, hi)``, ints with 0 <= lo <= hi <= N.
        """
        for name, v, top in (("rank", rank, self.n_ranks - 1), ("n_tokens", n_tokens, self.max_tokens_per_rank)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= v <= top:
                raise ValueError(f"{name}={v!r} must be an int in [0, {top}]")
        A, p, n = self.allreduce_world_size, int(rank) % self.allreduce_world_size, int(n_tokens)
        return (p * n) // A, ((p + 1) * n) // A

    @property
    def n_source_ranks(self) -> int:
        """Ranks whose tokens can reach one rank: all of them, or only itself with ``skip_a2a``."""
        return 1 if self.skip_a2a else self.n_ranks

    # ---- dispatch outputs ----------------------------------------------------------------------------------
    @property
    def row_offsets_len(self) -> int:
        return self.n_groups + 1

    @property
    def max_routed_rows(self) -> int:
        """Most routed rows one rank can receive: sources x T x min(K, L)."""
        return self.n_source_ranks * self.max_tokens_per_rank * min(self.top_k, self.n_local_experts)

    @property
    def capacity(self) -> int:
        """Rows of every dispatch output: routed rows, the shared expert's rows, and per-group padding."""
        shared = self.max_tokens_per_rank if self.fused_shared_expert else 0
        return self.max_routed_rows + shared + self.n_groups * (self.fmt.row_align - 1)

    @property
    def payload_bytes(self) -> int:
        return self.fmt.payload_bytes(self.hidden)

    @property
    def n_scales(self) -> int:
        return self.fmt.n_scales(self.hidden)

    @property
    def scale_k_tiles(self) -> int:
        return self.fmt.scale_k_tiles(self.hidden)

    @property
    def swizzled_scale_tiles(self) -> int:
        """Row tiles of 128 that the swizzled scales of ``capacity`` rows can need (each group starts a tile)."""
        return ceil_div(self.capacity, SCALE_TILE_ROWS) + self.n_groups

    @property
    def scales_shape(self) -> tuple[int, ...]:
        """Shape of the dispatch ``scales`` output: fp8 float32 [H/128, capacity]; fp4 uint8 [bytes]; bf16 ()."""
        if self.fmt.name == "fp8":
            return (self.n_scales, self.capacity)
        if self.fmt.swizzled_scales:
            return (self.swizzled_scale_tiles * self.scale_k_tiles * SCALE_TILE_BYTES,)
        return (0,)

    @property
    def combine_itemsize(self) -> int:
        return COMBINE_DTYPES[self.combine_dtype]

    # ---- symmetric buffers (per rank) ----------------------------------------------------------------------
    @property
    def n_counters(self) -> int:
        """int32 counters private to a rank (cuda_src/ep/state.cuh, enum Counter): round, completion and work
        counters (32 slots), then the per-expert histogram (E), which is also the slot counter of each expert, then
        a larger one-rank round's histogram by parity (2 x E counts, :data:`LOCAL_HIST_STRIDE` ints apart)."""
        return 32 + self.n_experts * (1 + 2 * LOCAL_HIST_STRIDE)

    @property
    def combine_poll_tokens(self) -> int:
        """Tokens t < this of a combine round whose partial sums go to ``comb_poll`` instead of ``comb_recv``: there
        the receiver polls the data itself (every 8-byte word starts as all ones, which no bf16 partial sum holds), so
        no arrival count, and no system-scope fence before it, is on the round's critical path. Nonzero for a
        bfloat16 combine whose partial sums fit in parity slots (2 x destination ranks <= top_k):
        min(max_tokens_per_rank, 256)."""
        if self.combine_dtype != "bfloat16" or 2 * self.combine_dest_ranks > self.top_k:
            return 0
        return min(self.max_tokens_per_rank, COMBINE_POLL_TOKENS)

    @property
    def combine_dest_ranks(self) -> int:
        """Ranks a combine sends partial sums to: every rank, or only itself with ``skip_a2a``."""
        return 1 if self.skip_a2a else self.n_ranks

    @property
    def small_book_len(self) -> int:
        """uint64 entries of a small round's book row (one per parity and source in each destination): the source's
        token mask for the destination (ceil(D / 32) words, D = small_batch_tokens), then each choice's expert and
        position in its (expert, source) block (D x top_k). 0 when small rounds are off."""
        D = self.small_batch_tokens
        return -(-D // 32) + D * self.top_k

    @property
    def stage_flag_bytes(self) -> int:
        """Bytes of a message's chunk flags (after its metadata in a staging record or a ``meta`` record): one uint32
        per 256-value span of the hidden size (a sender stores a token in at most that many chunks, each of which
        sets its own flag), 16-byte aligned."""
        return align_up(4 * -(-self.hidden // 256), 16)

    @property
    def stage_record_bytes(self) -> int:
        """Bytes of one staging record of a small round: metadata | chunk flags | payload."""
        return self.message.meta_bytes + self.stage_flag_bytes + self.message.payload_bytes

    @property
    def buffer_regions(self) -> dict[str, tuple[int, int]]:
        """Byte (offset, size) of every region of one rank's symmetric allocation, identical on every rank.

        Peers write: ``tokens`` (the dispatch output rows, [capacity, payload]), ``meta`` ([sources, T,
        meta_bytes + stage_flag_bytes]: one record per message of a large round, metadata then chunk flags),
        ``tally`` (uint64 [2 parities, sources, E + 2]:
        each source's expert histogram, token count and message count for this rank, each entry stamped with
        round + 1 in its high 32 bits), ``comb_recv`` ([T, K, H] in the combine dtype),
        ``comb_ready`` (uint64 [2, R]: from each rank, the combine rounds it lets in: any kind, then partial-sum
        rounds in parity slots), ``comb_arrived`` (int32 [2 parities, T, 32]: 16-byte vectors of combine data landed per
        token and round, one counter per 128-byte line; the receiver re-arms a parity one round ahead).
        ``counters`` (int32) and ``scratch`` (int32 [T, K] slots of each choice in its (expert, source) block,
        [T, 8] message slot per (token, destination) inside the token's range, [T] destination ranks of each token,
        [NOTIFY_RANGES, 8] first message slot of each token range per destination) are
        private to the rank.
        Peers also write ``stage`` ([2 parities, sources, small_batch_tokens, :attr:`stage_record_bytes`]: the
        messages of small rounds, record t for token t (metadata record, chunk flags, payload), which the receiver copies
        to their rows; then uint64 [2 parities, sources, :attr:`small_book_len`]: each source's book row, stamped
        like the tally). Peers write ``comb_poll`` (bf16 [2 parities, :attr:`combine_poll_tokens`, destination ranks,
        H]: the partial sums of a round's first tokens, polled by the receiver, which sets what it read back to all
        ones; empty when the combine cannot use it). ``scale_rows`` (private, uint32 [:attr:`scale_rows`]): where
        each row's scales are in a large dispatch round (byte offset / 4 from the buffer base), for the gather
        into the output layout at the round's end.
        There is no send buffer: a token is encoded once, in shared memory, and stored straight into each
        destination over NVLink.
        """
        S, E, T = self.n_source_ranks, self.n_experts, self.max_tokens_per_rank
        sizes = [("tokens", self.capacity * self.payload_bytes),
                 ("comb_recv", T * self.top_k * self.hidden * self.combine_itemsize),
                 ("meta", S * T * (self.message.meta_bytes + self.stage_flag_bytes)),
                 ("tally", 8 * 2 * S * (E + 2)),
                 ("comb_ready", 8 * 2 * self.n_ranks), ("comb_arrived", 4 * 2 * T * 32),
                 ("counters", 4 * self.n_counters),
                 ("scratch", 4 * (T * (self.top_k + 8 + 1) + NOTIFY_RANGES * 8)),
                 ("stage", 2 * S * (self.small_batch_tokens * self.stage_record_bytes + 8 * self.small_book_len)),
                 ("comb_poll", 2 * self.combine_poll_tokens * self.combine_dest_ranks * self.hidden * 2),
                 ("scale_rows", 4 * self.scale_rows)]
        out, off = {}, 0
        for name, size in sizes:
            out[name] = (off, size)
            off = align_up(off + size, 256)
        return out

    @property
    def buffer_bytes(self) -> int:
        """Symmetric memory per rank (what ``cuep.Buffer`` allocates on each GPU), dispatch ``tokens`` included."""
        off, size = list(self.buffer_regions.values())[-1]
        return align_up(off + size, 256)

    @property
    def handle_bytes(self) -> int:
        """Per-round bookkeeping combine reads back (row -> source, weight; message -> rows, weights, token, slot)."""
        msgs = self.n_source_ranks * self.max_tokens_per_rank
        return self.capacity * 8 + msgs * (8 * self.top_k + 8)

    @property
    def output_bytes(self) -> int:
        """Dispatch outputs outside the symmetric buffer (scales and, fp4, a byte per scale tile: its rows that may
        be nonzero; src_info, bookkeeping), allocated once."""
        tile_bounds = self.swizzled_scale_tiles if self.fmt.swizzled_scales else 0
        return self.capacity * 8 + self.scales_bytes + tile_bounds + self.handle_bytes

    @property
    def scale_rows(self) -> int:
        """Rows of the dispatch output's scales: fp8 ``capacity``, fp4 128 per possible scale tile, bf16 0."""
        if self.fmt.name == "bf16":
            return 0
        return self.capacity if self.fmt.name == "fp8" else self.swizzled_scale_tiles * SCALE_TILE_ROWS

    @property
    def scales_bytes(self) -> int:
        """Bytes of the dispatch output's scales (fp8: float32 [n_scales, capacity]; fp4: the 128x4-tiled bytes;
        0 for bf16)."""
        if self.fmt.name == "bf16":
            return 0
        return 4 * self.n_scales * self.capacity if self.fmt.name == "fp8" else int(self.scales_shape[0])

    @property
    def total_bytes(self) -> int:
        return self.buffer_bytes + self.output_bytes

    def describe(self) -> str:
        """One paragraph of the derived sizes, for logs and notebooks."""
        gib = 1 / 2**30
        return (f"EP group: {self.n_ranks} ranks x {self.n_local_experts} local experts (E={self.n_experts}, "
                f"K={self.top_k}), H={self.hidden}, T={self.max_tokens_per_rank}, format {self.fmt.name}, "
                f"combine {self.combine_dtype}; message {self.message.nbytes} B; capacity {self.capacity} rows; "
                f"rounds of <= {self.small_batch_tokens} tokens staged; "
                + (f"shared expert split over all-reduce groups of {self.allreduce_world_size} ranks; "
                   if self.allreduce_world_size > 1 else "")
                + f"per rank: buffers {self.buffer_bytes * gib:.3f} GiB + outputs {self.output_bytes * gib:.3f} GiB")

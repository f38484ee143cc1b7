"""Token wire formats: sizes, offsets and scale layouts, shared by the reference, Python and the kernels.

A *format* says how one token row of ``hidden`` values travels and is stored:

| name    | payload                          | scales (per token)                                  |
| ------- | -------------------------------- | --------------------------------------------------- |
| bf16    | H x bfloat16                     | none                                                |
| fp8     | H x float8_e4m3fn                | H/128 x float32 (one per 128-element block)         |
| nvfp4   | H/2 bytes, two e2m1 per byte     | H/16 x float8_e4m3fn (one per 16-element block)     |
| mxfp4   | H/2 bytes, two e2m1 per byte     | H/32 x float8_e8m0fnu (one per 32-element block)    |

Element ``2i`` of a packed e2m1 pair lives in the low nibble of byte ``i``.
Every part of a message starts on a 16-byte boundary (:data:`ALIGN`).
"""
from __future__ import annotations

from dataclasses import dataclass

ALIGN = 16
"""Device alignment in bytes: every part of a message, every buffer region starts on it."""

# Quantization constants (the kernels read the same numbers from formats.cuh; a test checks they agree).
FP8_BLOCK = 128
FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
E2M1_MAX = 6.0
# nvfp4's global scale g must lie in [GLOBAL_SCALE_MIN, GLOBAL_SCALE_MAX] (as float32): the kernels divide g by
# the block scale with FMAs (no IEEE division), exact for every g in this range (docs/formats.md).
GLOBAL_SCALE_MIN = 2.0**-100
GLOBAL_SCALE_MAX = 2.0**100

# 128 x 4 block-scale tiles that block-scaled grouped GEMMs read (cuBLAS "1D block scaling factors layout").
SCALE_TILE_ROWS = 128
SCALE_TILE_COLS = 4
SCALE_TILE_BYTES = SCALE_TILE_ROWS * SCALE_TILE_COLS


def align_up(n: int, a: int = ALIGN) -> int:
    """Round ``n`` up to a multiple of ``a``."""
    return -(-n // a) * a


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Format:
    """One token wire format.

    Attributes:
        name: ``"bf16" | "fp8" | "nvfp4" | "mxfp4"``.
        group: ``hidden`` must be a multiple of this (the scale block, or one 16-byte vector for bf16).
        block: elements per scale (0 for bf16).
        scale_itemsize: bytes per scale (0 for bf16).
        packed: two values per payload byte (e2m1).
        row_align: rows of each expert group are padded to a multiple of this in ``row_offsets`` (a power of two:
            the kernels pad with a mask).
        swizzled_scales: dispatch/fused_silu lay the scales out in 128x4 tiles (else float32 [H/block, rows]).
    """

    name: str
    group: int
    block: int
    scale_itemsize: int
    packed: bool
    row_align: int
    swizzled_scales: bool

    def __post_init__(self) -> None:
        if self.row_align < 1 or self.row_align & (self.row_align - 1):
            raise ValueError(f"format {self.name!r}: row_align={self.row_align} must be a power of two")

    @property
    def quantized(self) -> bool:
        return self.block > 0

    def payload_bytes(self, hidden: int) -> int:
        """Bytes of one token's payload."""
        if self.name == "bf16":
            return 2 * hidden
        return hidden // 2 if self.packed else hidden

    def n_scales(self, hidden: int) -> int:
        """Scales per token (0 for bf16)."""
        return hidden // self.block if self.block else 0

    def scale_bytes(self, hidden: int) -> int:
        """Bytes of one token's scales, unpadded."""
        return self.n_scales(hidden) * self.scale_itemsize

    def scale_k_tiles(self, hidden: int) -> int:
        """Number of 4-column scale tiles across one row (swizzled formats)."""
        return ceil_div(self.n_scales(hidden), SCALE_TILE_COLS)


FORMATS: dict[str, Format] = {
    "bf16": Format("bf16", group=8, block=0, scale_itemsize=0, packed=False, row_align=1,
                   swizzled_scales=False),
    "fp8": Format("fp8", group=FP8_BLOCK, block=FP8_BLOCK, scale_itemsize=4, packed=False, row_align=4,
                  swizzled_scales=False),
    "nvfp4": Format("nvfp4", group=NVFP4_BLOCK, block=NVFP4_BLOCK, scale_itemsize=1, packed=True,
                    row_align=1, swizzled_scales=True),
    "mxfp4": Format("mxfp4", group=MXFP4_BLOCK, block=MXFP4_BLOCK, scale_itemsize=1, packed=True,
                    row_align=1, swizzled_scales=True),
}


def get_format(name: str, argname: str = "fmt") -> Format:
    """Look a format up by name; ``ValueError`` naming ``argname`` if unknown."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"{argname}={name!r} is not a wire format; choose one of {sorted(FORMATS)}") from None


def check_hidden(fmt: Format, hidden: int, argname: str = "hidden") -> None:
    """``ValueError`` unless ``hidden`` is a positive multiple of the format's group."""
    if not isinstance(hidden, int) or hidden < 1 or hidden % fmt.group:
        raise ValueError(f"{argname}={hidden!r} must be a positive multiple of {fmt.group} "
                         f"(the group of format {fmt.name!r})")


@dataclass(frozen=True)
class MessageLayout:
    """What one token sends to one destination rank: its payload and a small metadata record.

    The payload (``payload_bytes``) is stored straight into the destination's expert-major ``tokens`` output, at
    the row of the first local expert the token chose there; the receiver copies it to the rows of its other
    local experts. The metadata record goes to the destination's ``meta[source rank, slot]`` (followed there by
    the message's chunk flags, :attr:`cuep.EPConfig.stage_flag_bytes`) and reads:
    ``header (src token index int32, 16 B) | topk_ids uint16 x K |
    topk_weights float32 x K |
    topk_rows int32 x K (destination row of each choice, -1 if on another rank) | scales (format's scale bytes)``.
    Every part starts on a 16-byte boundary.
    """

    payload_bytes: int
    src_offset: int
    topk_ids_offset: int
    topk_weights_offset: int
    topk_rows_offset: int
    scales_offset: int
    scale_bytes: int
    meta_bytes: int

    @property
    def nbytes(self) -> int:
        """Bytes one token moves to one destination rank."""
        return self.payload_bytes + self.meta_bytes

    @staticmethod
    def make(fmt: Format, hidden: int, top_k: int) -> "MessageLayout":
        ids_off = ALIGN
        w_off = ids_off + align_up(2 * top_k)
        rows_off = w_off + align_up(4 * top_k)
        scales_off = rows_off + align_up(4 * top_k)
        scales = fmt.scale_bytes(hidden)
        return MessageLayout(fmt.payload_bytes(hidden), 0, ids_off, w_off, rows_off, scales_off, scales,
                             scales_off + align_up(scales))


def swizzled_scale_offset(row: int, col: int, n_k_tiles: int) -> int:
    """Byte offset of scale (row, col) in the 128x4-tiled layout of a matrix whose rows start at a tile.

    Tiles run row-tile-major with the K tile fastest; inside a 512-byte tile,
    ``offset = (r % 32) * 16 + (r // 32) * 4 + c`` with ``r = row % 128`` and ``c = col % 4``.
    """
    rt, r = divmod(row, SCALE_TILE_ROWS)
    kt, c = divmod(col, SCALE_TILE_COLS)
    return (rt * n_k_tiles + kt) * SCALE_TILE_BYTES + (r % 32) * 16 + (r // 32) * 4 + c

"""The NumPy contract of cuep: every GPU kernel is tested against these functions.

Pure NumPy and ml_dtypes (no GPU). Quantization is bit-exact (see ``docs/formats.md``); dispatch returns rows in a
canonical order (ascending source token inside each (expert, source rank) block) so GPU results can be compared as
sets keyed by (source rank, token, k).
"""
from .quant import (dequantize, e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, ftz, pack_e2m1, quantize,
                    swizzle_block_scales, unpack_e2m1, unswizzle_block_scales)
from .ep import Dispatched, combine, dispatch, fused_silu

__all__ = ["quantize", "dequantize", "swizzle_block_scales", "unswizzle_block_scales", "dispatch", "combine",
           "fused_silu", "Dispatched", "e2m1_encode", "e2m1_decode", "e4m3_encode", "e4m3_decode", "pack_e2m1",
           "unpack_e2m1", "ftz"]

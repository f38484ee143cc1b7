// cuep wire formats on the device: the bit-exact rules of docs/formats.md (the NumPy oracle is cuep.reference).
// formats/elements.cuh: element codecs; formats/warp_quant.cuh: the warp quantizer, loads and scale sinks;
// formats/rows.cuh: row loops and work items.
//
// Element primitives (e4m3, e2m1, bf16, powers of two, FTZ, fused_silu's float32 silu), the 128x4 swizzled scale
// offset, and a WARP-level quantizer that every kernel producing a quantized row reuses (quantize, fused_silu,
// dispatch):
//
//   a warp step covers 256 values, 8 consecutive ones per lane (one 16-byte bf16 load, two for float32); with an
//   even number of steps per span (quantize, fused_silu) the steps go in pairs and each lane holds 16 consecutive
//   values instead (two adjacent 16-byte loads). A scale block is an aligned group of lanes (8 values per lane:
//   fp8 16 lanes, nvfp4 2, mxfp4 4; 16 per lane: fp8 8, nvfp4 1, mxfp4 2); the block amax is reduced with
//   __shfl_xor_sync inside that group; every lane writes its own payload bytes and the block's first lane (the
//   leader) its scale.
//
// Arithmetic: every float32 multiply, add and divide of the contract is an explicit __fmul_rn / __fadd_rn /
// __fsub_rn / __fdiv_rn, IEEE round-to-nearest and never contracted into an FMA, so -fmad cannot change a result;
// the only FMAs are the fp8 quotient's exact corrections (div_rn_by). CuPy compiles with -ftz=true: these, fabsf,
// fminf and fmaxf flush subnormal operands and results to zero of the same sign, which is the contract's FTZ policy
// (the PTX shows div.rn.ftz, mul.rn.ftz, max.ftz). Conversions the flag does not cover are done with bit operations
#pragma once
#include "formats/elements.cuh"
#include "formats/rows.cuh"
#include "formats/warp_quant.cuh"

// cuep expert-parallel plumbing shared by dispatch.cu and combine.cu (one header per concern):
//   ep/params.cuh     the kernel parameter structs (EPParams, DispatchArgs, CombineArgs) and phase bits
//   ep/state.cuh      per-rank counters and rounds, error records, bounded spinning
//   ep/transport.cuh  the transport seam: puts, signals and polls across ranks (NVLink peer stores today)
//   ep/sync.cuh       bounded waits, grid barriers, work items and their order
//   ep/routing.cuh    which choices are valid, which ranks a round writes to
#pragma once
#include "ep/params.cuh"
#include "ep/routing.cuh"
#include "ep/state.cuh"
#include "ep/sync.cuh"
#include "ep/transport.cuh"

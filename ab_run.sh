#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUPY_CACHE_DIR=/tmp/cupy_cache PYTHONPATH=.:tests
export CUEP_EXTRA_DEFINES="CUEP_AB_TRACE=1"
timeout 200 python3 scripts/trace_ep.py --tokens 128 2>&1 | tail -36

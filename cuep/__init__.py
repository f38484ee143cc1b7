"""cuep: Mixture-of-Experts expert-parallel dispatch and combine on NVIDIA GPUs, with a NumPy-style API on CuPy.

Data flows one way: :class:`EPConfig` (sizes, formats) -> :func:`init` (one process, all GPUs) or
:func:`init_distributed` (one process per GPU, started by ``python -m cuep.run``) -> :class:`Buffer`
(symmetric memory, peers) -> :func:`dispatch` -> your grouped expert GEMMs -> :func:`combine`.
:mod:`cuep.reference` is the NumPy contract every kernel is tested against; :mod:`cuep.ops` holds the single-GPU
kernels (quantize, dequantize, swizzle_block_scales, fused_silu); :mod:`cuep.moe` is a whole MoE layer built on them.

Importing cuep loads no CUDA library (the modules import CuPy inside the functions that need it), so it is cheap on a
machine without a GPU and in the ``python -m cuep.run`` launcher.
"""
from .buffer import Buffer, EPError
from .config import EPConfig
from .ep import Dispatched, combine, combine_async, combine_wait, dispatch, dispatch_async, dispatch_wait
from .formats import FORMATS, Format, MessageLayout
from .group import Group, init, init_distributed
from ._kernels import compile_kernels
from . import moe, ops, reference

__version__ = "0.1.0"

__all__ = ["EPConfig", "Buffer", "EPError", "Group", "init", "init_distributed", "dispatch", "dispatch_async",
           "dispatch_wait", "combine", "combine_async", "combine_wait", "Dispatched", "FORMATS", "Format",
           "MessageLayout", "compile_kernels", "ops", "reference", "moe", "__version__"]

"""cuep: Mixture-of-Experts expert-parallel dispatch and combine on NVIDIA GPUs, with a NumPy-style API on CuPy.

Data flows one way: :class:`EPConfig` (sizes, formats) -> :func:`init` (one process, all GPUs) or
:func:`init_distributed` (one process per GPU, started by ``python -m cuep.run``) -> :class:`Buffer`
(symmetric memory, peers) -> :func:`dispatch` -> your grouped expert GEMMs -> :func:`combine`.
:mod:`cuep.reference` is the NumPy contract every kernel is tested against.
"""
from .buffer import Buffer, EPError
from .config import EPConfig
from .ep import Dispatched, combine, combine_async, combine_wait, dispatch, dispatch_async, dispatch_wait
from .formats import FORMATS, Format, MessageLayout
from .group import Group, init, init_distributed

__version__ = "0.1.0"

__all__ = ["EPConfig", "Buffer", "EPError", "Group", "init", "init_distributed", "dispatch", "dispatch_async",
           "dispatch_wait", "combine", "combine_async", "combine_wait", "Dispatched", "FORMATS", "Format",
           "MessageLayout", "__version__"]

"""Who the ranks are and how they reach each other's memory.

Two ways to run, one set of kernels:

* one process driving all local GPUs (:func:`init`, the Jupyter way): peer access between every pair of devices,
  and every call takes and returns one array per rank;
* one process per GPU (:func:`init_distributed`, added with the launcher ``python -m cuep.run``): buffers shared
  through ``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle``.

A group may also place several ranks on one device (``init(devices=[0, 0, 0, 0])``): the kernels then run rank by
rank on one stream. That is for testing the multi-rank protocol on a single GPU, not for speed.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Group:
    """The ranks of an expert-parallel group as seen from this process.

    Attributes:
        devices: CUDA device of each rank this process drives (one entry per local rank).
        ranks: global rank of each local rank.
        n_ranks: ranks in the whole group.
        kind: ``"local"`` (one process drives every rank) or ``"ipc"`` (one process per rank).
    """

    devices: list[int]
    ranks: list[int]
    n_ranks: int
    kind: str = "local"
    _closed: bool = field(default=False, repr=False)

    @property
    def shares_devices(self) -> bool:
        """Several ranks on one device (the protocol then runs rank by rank, phase by phase)."""
        return len(set(self.devices)) < len(self.devices)

    @property
    def n_local(self) -> int:
        return len(self.devices)

    def __repr__(self) -> str:
        return f"Group(kind={self.kind!r}, n_ranks={self.n_ranks}, devices={self.devices})"


def _enable_peer_access(devices: list[int]) -> None:
    import cupy

    rt = cupy.cuda.runtime
    distinct = sorted(set(devices))
    for a in distinct:
        for b in distinct:
            if a == b:
                continue
            if not rt.deviceCanAccessPeer(a, b):
                raise RuntimeError(f"GPU {a} cannot access GPU {b} directly (no NVLink/PCIe peer path); cuep's "
                                   f"single-process mode needs peer access between every pair of devices")
            with cupy.cuda.Device(a):
                try:
                    rt.deviceEnablePeerAccess(b)
                except rt.CUDARuntimeError as e:  # already enabled is fine
                    if "PeerAccessAlreadyEnabled" not in str(e) and "already" not in str(e).lower():
                        raise


def init(devices: list[int] | None = None) -> Group:
    """A group of one rank per device, all driven by this process (peer access enabled between every pair).

    Args:
        devices: CUDA device ids, rank i on ``devices[i]``; default all visible devices. Repeating a device puts
            several ranks on it (protocol testing on one GPU).

    Raises:
        RuntimeError: no GPU, or a pair of devices without peer access.
        ValueError: an empty list, more than 8 ranks, or an unknown device id.
    """
    import cupy

    if not cupy.cuda.is_available():
        raise RuntimeError("cuep.init needs an NVIDIA GPU and driver; none is visible (cupy.cuda.is_available() is "
                           "False). cuep.reference runs the same contract on the CPU.")
    n_dev = cupy.cuda.runtime.getDeviceCount()
    if devices is None:
        devices = list(range(n_dev))
    devices = [int(d) for d in devices]
    if not devices:
        raise ValueError("devices must name at least one GPU")
    if len(devices) > 8:
        raise ValueError(f"devices has {len(devices)} entries; a node-local group holds at most 8 ranks")
    bad = [d for d in devices if not 0 <= d < n_dev]
    if bad:
        raise ValueError(f"devices {bad} do not exist: {n_dev} GPU(s) are visible (ids 0..{n_dev - 1})")
    _enable_peer_access(devices)
    return Group(devices=devices, ranks=list(range(len(devices))), n_ranks=len(devices), kind="local")

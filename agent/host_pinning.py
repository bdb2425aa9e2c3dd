"""Page-locking the agent's shared memory for DMA to and from the GPU, and unlocking it before it is unmapped.

CUDA keeps a registration (`cudaHostRegister`) until `cudaHostUnregister`; unmapping registered memory and mapping
something else at that address leaves the driver with a stale registration. So the block mover unregisters a view
before it drops the last reference to its mapping, and a registration that failed is logged and not counted as
one (the copies still work, through pageable memory). The calls go through `HostPinning`, so the order is tested
without a GPU; `CudaHostPinning` is what runs when the caches are on a GPU.
"""

from __future__ import annotations

import logging
from typing import Protocol

log = logging.getLogger("vllm.kvgate_connector")


class HostPinning(Protocol):
    """Register / unregister host memory with the device driver; each returns the driver's error code (0: ok)."""

    def register(self, address: int, size: int) -> int: ...

    def unregister(self, address: int) -> int: ...


class CudaHostPinning:
    def register(self, address: int, size: int) -> int:
        import torch

        return int(torch.cuda.cudart().cudaHostRegister(address, size, 0))

    def unregister(self, address: int) -> int:
        import torch

        return int(torch.cuda.cudart().cudaHostUnregister(address))


class PinnedRegion:
    """One registration of [address, address + size): `release()` before the memory is unmapped."""

    def __init__(self, pinning: HostPinning, address: int, size: int) -> None:
        self.pinning = pinning
        self.address = address
        self.size = size
        error = pinning.register(address, size)
        self.pinned = error == 0
        if not self.pinned:
            log.warning("kvgate connector: cudaHostRegister of %d bytes of shared memory failed (error %d); "
                        "copies go through pageable memory", size, error)

    def release(self) -> None:
        if not self.pinned:
            return
        self.pinned = False
        error = self.pinning.unregister(self.address)
        if error:
            log.warning("kvgate connector: cudaHostUnregister of the shared memory failed (error %d)", error)

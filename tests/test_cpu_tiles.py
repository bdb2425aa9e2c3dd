"""The connector asks Linux for the AMX tile state (agent/cpu_tiles.py): granted exactly where the CPU has AMX."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _cpu_has_amx_tiles() -> bool:
    if platform.machine() != "x86_64":
        return False
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return "amx_tile" in flags.split()


def test_the_tile_state_is_granted_where_the_cpu_has_amx() -> None:
    """In a fresh process (a grant lasts for the process): not permitted before the request, permitted after it,
    where the CPU has AMX; nothing granted elsewhere."""
    probe = ("from agent.cpu_tiles import amx_tiles_permitted, request_amx_tiles\n"
             "before = amx_tiles_permitted()\n"
             "granted = request_amx_tiles()\n"
             "print(before, granted, amx_tiles_permitted())\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True).stdout.split()
    amx = _cpu_has_amx_tiles()
    assert out == ["False", str(amx), str(amx)]

"""Running a service's main coroutine: uvloop when available, clean cancellation on SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine
from typing import Any


def run_until_signalled(main: Coroutine[Any, Any, None]) -> None:
    async def guarded() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await main

    try:
        import uvloop
    except ImportError:
        asyncio.run(guarded())
    else:
        uvloop.run(guarded())

"""A stand-in for a vLLM server's process tree, for the tests of how servers are stopped: this process (the API
server) starts an engine core, which starts a (daemonic) worker, each with multiprocessing's spawn context, as vLLM
does (vllm/v1/engine/utils.py, vllm/v1/executor/multiproc_executor.py). Prints each child's PID on a line of its own,
engine core first; each process waits for its child.

    python tests/process_family.py [--detach] [--stubborn]

--detach: the worker starts a session of its own (as vLLM's DP supervisor's children and snapshot servers do), out
of reach of its group's signals. --stubborn: the worker ignores SIGTERM (a vLLM worker ignores a second one, and
one busy in native code does not get to its handler).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time

SPAWN = multiprocessing.get_context("spawn")


def worker(detach: bool, stubborn: bool) -> None:
    if detach:
        os.setsid()
    if stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(300)


def engine_core(detach: bool, stubborn: bool) -> None:
    proc = SPAWN.Process(target=worker, args=(detach, stubborn), name="Worker", daemon=True)
    proc.start()
    print(proc.pid, flush=True)
    proc.join()


def main(argv: list[str]) -> None:
    detach, stubborn = "--detach" in argv, "--stubborn" in argv
    proc = SPAWN.Process(target=engine_core, args=(detach, stubborn), name="EngineCore")
    proc.start()
    print(proc.pid, flush=True)
    proc.join()


if __name__ == "__main__":
    main(sys.argv[1:])

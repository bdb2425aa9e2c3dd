"""The connector's worker half (agent/block_mover.py) on vLLM's torch, without an engine, driven line by line.

Run with the vLLM venv's Python: `python tests/mover_probe.py SOCKET SHM_BYTES`. It builds two CPU KV caches of
vLLM's layout -- `source` with random content, `target` zeroed -- and a BlockMover on the agent at SOCKET, then
answers one JSON command per stdin line with one JSON line on stdout:
  {"op": "attach"}                                     -> {"attached": bool}
  {"op": "save", "hashes": [...], "blocks": [...]}     -> {"failure": reason | null}   (from `source`)
  {"op": "load", "hashes": [...], "blocks": [...]}     -> {"loaded": n, "failure": reason | null, "correct": bool}
      (into `target`; `correct`: each loaded block equals the `source` block saved under its hash)
  {"op": "save_step", "chains": [{"hashes": [...], "blocks": [...], "parent": h | null}, ...]}
      -> {"done": bool, "round_trips": n}  (a step's saves through the connector's transfer thread, queued together;
          the agent round trips they took)
  {"op": "counters"}                                   -> {"load": {reason: n}, "save": {reason: n}}
  {"op": "view_outlives_close"}                        -> {"mapped": bool}  (the staging view after client.close())
"""

from __future__ import annotations

import json
import sys

import torch

from agent.block_mover import BlockMover
from agent.client import AgentClient
from agent.kv_layout import describe_layers
from agent.transfers import SaveJob, TransferThread

NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_DIM, LAYERS = 32, 2, 32, 32, 2
LAYOUT = 0x1A7E


def mapped(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            low, high = (int(x, 16) for x in line.split()[0].split("-"))
            if low <= address < high:
                return True
    return False


def main() -> None:
    socket_path, shm_bytes = sys.argv[1], int(sys.argv[2])
    gen = torch.Generator().manual_seed(7)
    shape = (NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    source = {f"l{i}": torch.randn(shape, generator=gen).to(torch.bfloat16) for i in range(LAYERS)}
    target = {name: torch.zeros_like(t) for name, t in source.items()}
    client = AgentClient(socket_path, shm_bytes=shm_bytes, timeout_s=2.0, name="mover-probe")
    mover = BlockMover(client, LAYOUT, describe_layers(target, NUM_BLOCKS))
    saver = BlockMover(client, LAYOUT, describe_layers(source, NUM_BLOCKS))
    saved: dict[int, int] = {}  # hash -> source block
    transfers: TransferThread | None = None
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        reply: dict[str, object]
        if op == "attach":
            reply = {"attached": mover.attach()}
        elif op == "save":
            failure = saver.save(command["hashes"], command["blocks"], command.get("parent"))
            if failure is None:
                saved.update(zip(command["hashes"], command["blocks"], strict=True))
            reply = {"failure": failure}
        elif op == "load":
            result = mover.load(command["hashes"], command["blocks"])
            correct = all(torch.equal(target[name][dst], source[name][saved[h]])
                          for h, dst in zip(command["hashes"][: result.loaded], command["blocks"], strict=False)
                          for name in source)
            reply = {"loaded": result.loaded, "failure": result.failure, "correct": correct}
        elif op == "save_step":
            if transfers is None:
                transfers = TransferThread(saver)  # from now on the only user of the client
            before = client.round_trips
            jobs = [SaveJob(f"r{i}", c["hashes"], c["blocks"], c.get("parent"))
                    for i, c in enumerate(command["chains"])]
            transfers.save(jobs)
            done = transfers.wait_for_saves([job.req_id for job in jobs], 20)
            for c in command["chains"]:
                saved.update(zip(c["hashes"], c["blocks"], strict=True))
            reply = {"done": done, "round_trips": client.round_trips - before}
        elif op == "counters":
            reply = {"load": {str(k): v for k, v in mover.load_failures.items()},
                     "save": {str(k): v for k, v in saver.save_failures.items()}}
        elif op == "view_outlives_close":
            mover.attach()
            staging = mover._staging
            assert staging is not None
            address = staging.tensor.data_ptr()
            client.close()
            reply = {"mapped": mapped(address)}
        else:
            reply = {"error": f"unknown op {op}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()

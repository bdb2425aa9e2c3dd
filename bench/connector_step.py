"""What the connector costs vLLM's step: the time the model runner spends in the worker's hooks (`start_load_kv`,
`wait_for_save`, `get_finished`) per step that saves a batch of blocks, asynchronous (the default) against
synchronous, through the real `KvgateConnector` and a real agent (no engine: the hooks are driven as the model
runner calls them). Also the time until the agent holds the batch (the transfer itself, off the step when
asynchronous). Rounds alternate the two connectors; medians.

`python -m bench.connector_step [--layers 32 --blocks 16 --steps 10 --rounds 3]`: caches of `--layers` layers of
vLLM's CPU layout `[num_blocks, 8, 16, 256]` bf16 (64 KiB per layer and block: 2 MiB blocks at 32 layers,
Llama-3.1-8B's size). The worker half runs in the vLLM venv.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from bench.make_model import write_model
from bench.procs import exit_on_sigterm
from bench.sim.launch import AgentSettings, agent_process
from bench.vllm_engine import ROOT, ensure_vllm_venv

WORKER = """
import json, statistics, sys, time
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.utils.gc_utils import freeze_gc_heap
from agent.client import AgentClient
from agent.vllm_connector import BlockTransfer, KvgateConnector, KvgateConnectorMetadata

model, socket, layers, blocks, steps, rounds = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
num_blocks = 2 * blocks
caches = {f"l{i}": torch.randn(num_blocks, 8, 16, 256).to(torch.bfloat16) for i in range(layers)}

def connector(asynchronous):
    extra = {"agent_socket": socket, "shm_bytes": 2 * blocks * layers * 65536 + (1 << 20),
             "async_transfers": asynchronous, "layout": f"step-bench-{asynchronous}"}
    config = EngineArgs(model=model, max_model_len=512, kv_transfer_config={
        "kv_connector": "KvgateConnector", "kv_connector_module_path": "agent.vllm_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra}).create_engine_config()
    worker = KvgateConnector(config, KVConnectorRole.WORKER, KVCacheConfig(num_blocks, [], []))
    worker.register_kv_caches(caches)
    return worker

workers = {"async": connector(True), "sync": connector(False)}
freeze_gc_heap()  # as vLLM's EngineCore does once the engine is up: a full collection of the start-up heap (0.3 s
# here) in a timed step is not the engine's (tests/test_connector_async.py: WORKER_SETUP)
client = AgentClient(socket, shm_bytes=0)
hook_ms = {name: [] for name in workers}
stored_ms = {name: [] for name in workers}
serial = 0
for _ in range(rounds):
    for name, worker in workers.items():
        for _ in range(steps):
            serial += 1
            hashes = [serial * 1000 + i for i in range(blocks)]
            meta = KvgateConnectorMetadata(saves=[BlockTransfer(f"r{serial}", list(range(blocks)), hashes)])
            start = time.perf_counter()
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            worker.wait_for_save()
            worker.get_finished(set())
            worker.clear_connector_metadata()
            hook_ms[name].append(1000 * (time.perf_counter() - start))
            while client.lookup(worker._layout, hashes)[0] < blocks:
                time.sleep(0.0002)
            stored_ms[name].append(1000 * (time.perf_counter() - start))
for worker in workers.values():
    worker.shutdown()
print(json.dumps({name: {"hook_ms_median": statistics.median(hook_ms[name]),
                         "hook_ms_p90": statistics.quantiles(hook_ms[name], n=10)[-1],
                         "stored_ms_median": statistics.median(stored_ms[name])} for name in workers}))
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=16, help="blocks saved per step")
    parser.add_argument("--steps", type=int, default=10, help="steps per round and connector")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvgate-connector-step-") as tmp:
        work = Path(tmp)
        write_model(work / "model")
        agent = agent_process(0, work, None, AgentSettings(write_policy="lazy", shared=False,
                                                           dram_capacity="8GiB"), 16, dict(os.environ))
        agent.start()
        try:
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            env.pop("VIRTUAL_ENV", None)
            out = subprocess.run([str(ensure_vllm_venv()), "-c", WORKER, str(work / "model"), agent.socket_path,
                                  str(args.layers), str(args.blocks), str(args.steps), str(args.rounds)],
                                 env=env, capture_output=True, text=True, timeout=1800)
        finally:
            agent.stop()
    if out.returncode != 0:
        raise SystemExit(out.stderr[-4000:])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    block_mib = args.layers * 65536 / 2**20
    print(json.dumps({"layers": args.layers, "blocks": args.blocks, "block_mib": block_mib, **result}))
    print(f"# {args.blocks} blocks of {block_mib:.0f} MiB saved per step, {args.rounds} x {args.steps} steps each")
    for name, row in result.items():
        print(f"# {name:<5}: the step's connector hooks {row['hook_ms_median']:7.2f} ms median "
              f"(p90 {row['hook_ms_p90']:.2f}); blocks in the agent {row['stored_ms_median']:7.2f} ms after the step")


if __name__ == "__main__":
    exit_on_sigterm()
    main()

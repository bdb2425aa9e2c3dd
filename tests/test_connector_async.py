"""The connector's asynchronous transfers (`async_transfers`), on vLLM's contract: no step waits for the agent --
loads and saves run in the worker's transfer thread; a load is reported in finished_recving with its failed blocks
in the same pass; a finished request's blocks are held (request_finished -> True) until its saves are done and the
workers name it in finished_sending; a preempted request's saves are done before the step reuses its blocks. The
worker half runs through the real KvgateConnector against a real agent process (some of it SIGSTOPped); the whole
of it in a real vLLM, with outputs identical to recomputation."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from bench.make_model import write_model
from bench.vllm_engine import BLOCK_SIZE, EngineServer
from tests import vllm_replica as replica
from tests.agent_process import AgentProcess
from tests.test_connector_integrity import run_in_vllm
from tests.vllm_replica import reset_prefix_cache, start_vllm

pytestmark = pytest.mark.timeout(900)

# A worker-side KvgateConnector with asynchronous transfers on CPU caches, set up as in vLLM's engine process: once
# the engine is up, EngineCore.__init__ freezes the heap (vllm.utils.gc_utils.freeze_gc_heap: collect, then
# gc.freeze()), so a full collection while it serves walks only what was made since. A script that imports vLLM,
# torch and transformers and skips that keeps about 610,000 objects in the collector's sight, and the first full
# collection the allocation counts call for stops whichever step it lands in for 0.3 s here -- which step that is
# depends on anything that allocates, such as the size of an installed package's METADATA (transformers parses
# every one at import): with sentry-sdk 2.76.0 in the venv (never imported), it landed in a hung-agent step of
# ASYNC_SCRIPT, 4 runs of 4.
WORKER_SETUP = """
import gc, json, os, signal, sys, threading, time
import torch
from vllm.utils.gc_utils import freeze_gc_heap
from vllm.engine.arg_utils import EngineArgs
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig
from agent.client import AgentClient
from agent.vllm_connector import BlockTransfer, KvgateConnector, KvgateConnectorMetadata

model, socket, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
extra = {"agent_socket": socket, "shm_bytes": 1 << 20, "timeout_s": 1.0, "probe_interval_s": 0.2,
         "async_transfers": True}
config = EngineArgs(model=model, max_model_len=512, kv_transfer_config={
    "kv_connector": "KvgateConnector", "kv_connector_module_path": "agent.vllm_connector", "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}).create_engine_config()
worker = KvgateConnector(config, KVConnectorRole.WORKER, KVCacheConfig(32, [], []))
gen = torch.Generator().manual_seed(3)
caches = {f"l{i}": torch.randn(32, 2, 16, 64, generator=gen).to(torch.bfloat16) for i in range(2)}
worker.register_kv_caches(caches)
freeze_gc_heap()  # as EngineCore does once the engine is up
"""

# Driven step by step as vLLM's model runner does.
ASYNC_SCRIPT = WORKER_SETUP + """
full_collections, collecting = [], {}  # seconds each full collection from here on took (a slow step that was one
def time_full_collections(phase, info):  # says so)
    if info["generation"] == 2 and phase == "start":
        collecting["at"] = time.monotonic()
    elif info["generation"] == 2:
        full_collections.append(time.monotonic() - collecting["at"])
gc.callbacks.append(time_full_collections)

def step(meta, finished=()):
    # the model runner's order: preemptions, loads, (forward), saves, then what finished
    start = time.monotonic()
    worker.handle_preemptions(meta)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    sent, recved = worker.get_finished(set(finished))
    errors = sorted(worker.get_block_ids_with_load_errors())
    worker.clear_connector_metadata()
    return time.monotonic() - start, sorted(sent or ()), sorted(recved or ()), errors

def until(want, meta=None, limit_s=10.0):
    # steps (the first with `meta`) until `want(sent, recved)`; every pass's (sent, recved, errors) and step time
    passes, deadline = [], time.monotonic() + limit_s
    meta = meta or KvgateConnectorMetadata()
    while True:
        took, sent, recved, errors = step(meta)
        passes.append({"s": took, "sent": sent, "recved": recved, "errors": errors})
        if want(sent, recved) or time.monotonic() > deadline:
            return passes
        meta = KvgateConnectorMetadata()
        time.sleep(0.005)

out = {}
held = lambda *ids: lambda sent, recved: set(ids) <= set(sent)
got = lambda *ids: lambda sent, recved: set(ids) <= set(recved)
# 1. b's blocks 5, 6 are computed and saved; b finishes (held) and is named in finished_sending once saved
out["save_s"] = step(KvgateConnectorMetadata(saves=[BlockTransfer("b", [5, 6], [201, 202])]))[0]
out["held"] = until(held("b"), KvgateConnectorMetadata(held=["b"]))
with AgentClient(socket, shm_bytes=0) as client:
    out["stored"] = client.lookup(worker._layout, [201, 202])[0]
# 2. a loads them into blocks 0, 1: named in finished_recving, no errors, the bytes are b's
out["load"] = until(got("a"), KvgateConnectorMetadata(loads=[BlockTransfer("a", [0, 1], [201, 202])]))
out["same_bytes"] = all(torch.equal(t[0], t[5]) and torch.equal(t[1], t[6]) for t in caches.values())
# 3. c asks for blocks the agent lacks: finished_recving names it and its blocks are errors in the same pass
out["missing"] = until(got("c"), KvgateConnectorMetadata(loads=[BlockTransfer("c", [2, 3], [201, 999])]))
# 4. the agent hangs: no step waits; the load finishes (failed) after one timeout, a save is dropped
os.kill(pid, signal.SIGSTOP)
out["hung"] = until(got("d"), KvgateConnectorMetadata(loads=[BlockTransfer("d", [7, 8], [201, 202])],
                                                      saves=[BlockTransfer("e", [9], [301])]))
# 5. with the circuit open, a preempted request's queued saves finish at once (they fail fast)
step(KvgateConnectorMetadata(saves=[BlockTransfer("p", [10], [401])]))
start = time.monotonic()
step(KvgateConnectorMetadata(preempted=["p"]))
out["preempt_open_s"] = time.monotonic() - start
out["p_in_flight"] = worker._transfers.saves_in_flight("p")
os.kill(pid, signal.SIGCONT)
deadline = time.monotonic() + 10
while worker._circuit.is_open and time.monotonic() < deadline:
    time.sleep(0.05)
# 6. back, but slow: a preempted request's save is done (stored) when handle_preemptions returns
os.kill(pid, signal.SIGSTOP)
step(KvgateConnectorMetadata(saves=[BlockTransfer("q", [11, 12], [501, 502])]))
threading.Timer(0.5, os.kill, (pid, signal.SIGCONT)).start()  # within the 1 s timeout: the save succeeds
start = time.monotonic()
step(KvgateConnectorMetadata(preempted=["q"]))
out["preempt_wait_s"] = time.monotonic() - start
with AgentClient(socket, shm_bytes=0) as client:
    out["q_stored"] = client.lookup(worker._layout, [501, 502])[0]
    out["e_stored"] = client.lookup(worker._layout, [301])[0]
stats = worker.get_kv_connector_stats()
out["stats"] = stats.data if stats is not None else {}
out["full_collections_s"] = full_collections
worker.shutdown()
print(json.dumps(out))
"""

# A load of more blocks than the shared memory holds (8 of 8 KiB here), whose second batch fails: vLLM is told
# the blocks from the first one not loaded on, and the batch that arrived is in the cache.
BATCHES_SCRIPT = WORKER_SETUP.replace('"shm_bytes": 1 << 20', '"shm_bytes": 8 * 8192') + """
from pathlib import Path
mode_file = Path(sys.argv[4])
out = {"block_bytes": worker._mover.block_bytes}
saved = list(range(12))
worker.bind_connector_metadata(KvgateConnectorMetadata(saves=[BlockTransfer("s", saved, list(range(601, 613)))]))
worker.wait_for_save()
worker.clear_connector_metadata()
assert worker._transfers.wait_for_saves(["s"], 20)
for mode in ("error_after_one", "hang_after_one"):
    mode_file.write_text(mode)
    target = list(range(16, 28))
    worker.bind_connector_metadata(KvgateConnectorMetadata(loads=[BlockTransfer(mode, target,
                                                                                list(range(601, 613)))]))
    worker.start_load_kv(None)
    worker.clear_connector_metadata()
    deadline, recved, errors = time.monotonic() + 20, set(), set()
    while mode not in recved and time.monotonic() < deadline:
        time.sleep(0.01)
        recved |= worker.get_finished(set())[1] or set()
        errors |= worker.get_block_ids_with_load_errors()
    loaded = [b for b in target if b not in errors]
    out[mode] = {"recved": sorted(recved), "errors": sorted(errors),
                 "loaded_whole": all(torch.equal(t[b], t[s]) for b, s in zip(loaded, saved) for t in caches.values())}
    mode_file.write_text("ok")
    while worker._circuit.is_open and time.monotonic() < deadline + 10:
        time.sleep(0.05)
    for b in target:  # the next load starts from nothing
        for t in caches.values():
            t[b].zero_()
stats = worker.get_kv_connector_stats()
out["stats"] = stats.data if stats is not None else {}
worker.shutdown()
print(json.dumps(out))
"""


def test_a_load_whose_second_batch_fails_tells_vllm_the_blocks_from_there_on(
        tmp_path: Path, agents: list[AgentProcess], subprocess_env: dict[str, str]) -> None:
    """Through the real connector (asynchronous transfers): 12 blocks through 8 blocks of shared memory, the
    agent answering the first batch and failing the second (an error reply; a hang past the timeout, which opens
    the circuit). vLLM gets the request in finished_recving with blocks 8-11 as load errors in the same pass, to be
    recomputed; blocks 0-7 are in the cache, the bytes saved under their hashes. Before, every block was an error:
    the batch that had arrived was counted as not loaded."""
    from tests.faulty_agent import FaultyAgentProcess

    agent = FaultyAgentProcess(tmp_path, subprocess_env, "--dram-capacity", "4MiB")
    agents.append(agent)
    assert agent.proc is not None
    model = tmp_path / "model"
    write_model(model)
    out = run_in_vllm(BATCHES_SCRIPT, str(model), agent.socket, str(agent.proc.pid), str(agent.mode_file))
    assert out["block_bytes"] == 8192
    for mode in ("error_after_one", "hang_after_one"):
        assert out[mode] == {"recved": [mode], "errors": list(range(24, 28)), "loaded_whole": True}, out
    assert out["stats"]["load"] == {"agent_unavailable": 2}, out


# What a step pays when a full collection lands in it, on the heap the steps above run on.
HEAP_SCRIPT = WORKER_SETUP + """
start = time.monotonic()
gc.collect()
took = time.monotonic() - start
worker.shutdown()
print(json.dumps({"full_collection_s": took, "frozen": gc.get_freeze_count()}))
"""


def test_async_transfers_never_wait_in_the_step_and_follow_vllms_contract(
        tmp_path: Path, agents: list[AgentProcess], subprocess_env: dict[str, str]) -> None:
    agent = AgentProcess(tmp_path, subprocess_env, "--dram-capacity", "4MiB")
    agents.append(agent)
    assert agent.proc is not None
    model = tmp_path / "model"
    write_model(model)
    out = run_in_vllm(ASYNC_SCRIPT, str(model), agent.socket, str(agent.proc.pid))
    assert out["save_s"] < 0.05
    assert out["held"][-1]["sent"] == ["b"] and out["stored"] == 2
    load = out["load"]
    assert load[-1]["recved"] == ["a"] and all(p["errors"] == [] for p in load) and out["same_bytes"]
    missing = out["missing"]
    assert missing[-1]["recved"] == ["c"] and missing[-1]["errors"] == [3]  # block 2 loaded, 3 (hash 999) not
    assert all(p["errors"] == [] for p in missing[:-1])  # not before the pass that names c
    hung = out["hung"]
    assert hung[-1]["recved"] == ["d"] and hung[-1]["errors"] == [7, 8]
    assert max(p["s"] for p in hung) < 0.05, out["full_collections_s"]  # no step waited for the hung agent
    assert len(hung) >= 10  # ... while the load took about a timeout
    assert out["preempt_open_s"] < 0.5 and not out["p_in_flight"]
    assert out["preempt_wait_s"] > 0.4 and out["q_stored"] == 2 and out["e_stored"] == 0
    assert out["stats"]["load"] == {"missing": 1, "agent_unavailable": 1}
    assert out["stats"]["save"].get("agent_unavailable", 0) >= 1


def test_the_steps_are_timed_on_a_heap_frozen_as_the_engines(
        tmp_path: Path, agents: list[AgentProcess], subprocess_env: dict[str, str]) -> None:
    """A full collection costs the timed steps what it costs the engine's: with vLLM's start-up heap left in the
    collector's sight, one took 0.3 s here, and whether it landed in a hung-agent step depended on unrelated
    allocations (sentry-sdk 2.76.0's metadata did it, 4 runs of 4): a step that looked as if it waited for the
    agent, which the engine would not have paid."""
    agent = AgentProcess(tmp_path, subprocess_env, "--dram-capacity", "4MiB")
    agents.append(agent)
    assert agent.proc is not None
    model = tmp_path / "model"
    write_model(model)
    out = run_in_vllm(HEAP_SCRIPT, str(model), agent.socket, str(agent.proc.pid))
    assert out["full_collection_s"] < 0.05, out
    assert out["frozen"] > 100_000  # vLLM, torch, transformers and the connector: out of the collector's sight


PROMPT = " ".join(f"word{i} alpha beta gamma" for i in range(120))


@pytest.mark.vllm
@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_vllm_saves_loads_and_answers_identically_with_either_transfers(
        asynchronous: bool, weighted_model: Path, tmp_path: Path, subprocess_env: dict[str, str],
        servers: list[EngineServer], agents: list[AgentProcess]) -> None:
    """Real vLLM, asynchronous (the default) or synchronous loads and saves: the blocks saved by the first request
    come back from the agent after the engine forgets them (asynchronously: WAITING_FOR_REMOTE_KVS, then
    scheduled), with the same output and logprobs."""
    agent = AgentProcess(tmp_path / "a", subprocess_env, "--block-size", str(BLOCK_SIZE))
    agents.append(agent)
    vllm = start_vllm(weighted_model, tmp_path / "logs", agent.socket,
                      connector_extra={"async_transfers": asynchronous})
    servers.append(vllm)
    text, logprobs, cached, prompt_tokens = replica.complete(vllm, PROMPT)
    assert cached == 0
    expected = replica.loadable_tokens(prompt_tokens)
    deadline = time.monotonic() + 30
    while agent.metric("kvgate_agent_tier_blocks", tier="dram") < expected // BLOCK_SIZE:
        assert time.monotonic() < deadline, "the saves never reached the agent"
        time.sleep(0.1)
    for _ in range(2):
        reset_prefix_cache(vllm)
        assert replica.complete(vllm, PROMPT) == (text, logprobs, expected, prompt_tokens)
    assert agent.metric("kvgate_agent_hits_total", tier="dram") >= 2 * expected // BLOCK_SIZE
    assert (", asynchronous transfers" if asynchronous else ", synchronous transfers") in vllm.log_tail(2_000_000)


# Where the transfer thread runs on a CPU worker: this process stands in for vLLM's worker, bound to one core of
# its parent's (the test's), as vLLM binds its CPU workers; the thread saves through a real agent either way.
CORES_SCRIPT = """
import json, os, sys, time
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig
from agent.client import AgentClient
from agent.vllm_connector import BlockTransfer, KvgateConnector, KvgateConnectorMetadata

model, socket, cores = sys.argv[1], sys.argv[2], sys.argv[3]
worker_cpu = min(os.sched_getaffinity(os.getppid()))
os.sched_setaffinity(0, {worker_cpu})  # as vLLM binds a CPU worker (every thread it starts inherits it)
extra = {"agent_socket": socket, "shm_bytes": 1 << 20, "timeout_s": 5.0, "async_transfers": True,
         "transfer_cores": cores}
config = EngineArgs(model=model, max_model_len=512, kv_transfer_config={
    "kv_connector": "KvgateConnector", "kv_connector_module_path": "agent.vllm_connector", "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}).create_engine_config()
worker = KvgateConnector(config, KVConnectorRole.WORKER, KVCacheConfig(32, [], []))
caches = {f"l{i}": torch.randn(32, 2, 16, 64).to(torch.bfloat16) for i in range(2)}
worker.register_kv_caches(caches)
worker.bind_connector_metadata(KvgateConnectorMetadata(saves=[BlockTransfer("r", [3, 4], [701, 702])]))
worker.start_load_kv(None)
worker.wait_for_save()
worker.clear_connector_metadata()
done = worker._transfers.wait_for_saves(["r"], 30)  # the thread has run past where it places itself
with AgentClient(socket, shm_bytes=0) as client:
    stored = client.lookup(worker._layout, [701, 702])[0]
thread_cpus = sorted(os.sched_getaffinity(worker._transfers._thread.native_id))
worker.shutdown()
print(json.dumps({"worker_cpu": worker_cpu, "thread_cpus": thread_cpus, "done": done, "stored": stored}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core besides the worker's")
@pytest.mark.parametrize("cores", ["reserved", "worker"])
def test_the_transfer_thread_runs_where_transfer_cores_says(
        cores: str, tmp_path: Path, agents: list[AgentProcess], subprocess_env: dict[str, str]) -> None:
    agent = AgentProcess(tmp_path, subprocess_env, "--dram-capacity", "4MiB")
    agents.append(agent)
    model = tmp_path / "model"
    write_model(model)
    out = run_in_vllm(CORES_SCRIPT, str(model), agent.socket, cores)
    assert out["done"] and out["stored"] == 2
    mine = sorted(os.sched_getaffinity(0))
    if cores == "worker":
        assert out["thread_cpus"] == [out["worker_cpu"]]
    else:
        assert out["thread_cpus"] == [c for c in mine if c != out["worker_cpu"]]

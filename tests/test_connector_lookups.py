"""The scheduler's lookups never hold up a step: vLLM's scheduler asks the connector about each waiting request,
and the connector answers from a lookup thread -- the agent's answer if it comes within `lookup_wait_ms` (shared
by the whole step), otherwise None ("ask again next step", vLLM's contract), and 0 (compute) once the request has
waited `lookup_give_up_ms` or the agent's circuit is open. The real KvgateConnector's scheduler half, vLLM's own
Request objects and block hashes, and a real agent process over its socket, SIGSTOPped and resumed."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bench.make_model import write_model
from bench.vllm_engine import BLOCK_SIZE, EngineServer
from tests import vllm_replica as replica
from tests.agent_process import AgentProcess
from tests.test_connector_integrity import run_in_vllm
from tests.vllm_replica import reset_prefix_cache, start_vllm

pytestmark = pytest.mark.timeout(600)

SCHEDULER_SCRIPT = """
import json, os, signal, sys, time
from vllm.engine.arg_utils import EngineArgs
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.request import Request
from vllm.utils.gc_utils import freeze_gc_heap
from agent.client import AgentClient
from agent.vllm_connector import KvgateConnector, event_hash

model, socket, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
extra = {"agent_socket": socket, "timeout_s": 2.0, "probe_interval_s": 0.2, "lookup_wait_ms": 1.0,
         "lookup_give_up_ms": 500, **json.loads(sys.argv[4])}
config = EngineArgs(model=model, max_model_len=512, kv_transfer_config={
    "kv_connector": "KvgateConnector", "kv_connector_module_path": "agent.vllm_connector", "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}).create_engine_config()
sched = KvgateConnector(config, KVConnectorRole.SCHEDULER, KVCacheConfig(32, [], []))
bs = config.cache_config.block_size
hash_fn = get_hash_fn_by_name("sha256")
init_none_hash(hash_fn)
hasher = get_request_block_hasher(bs, hash_fn)
freeze_gc_heap()  # as EngineCore does once the engine is up (tests/test_connector_async.py: WORKER_SETUP)

def request(name, blocks):
    tokens = [(sum(map(ord, name)) * 7919 + j) % 30000 for j in range(blocks * bs + 3)]
    return Request(name, tokens, SamplingParams(max_tokens=4), None, block_hasher=hasher)

def step(requests):
    # one scheduler step: the connector is asked about each waiting request, then builds the step's metadata
    start = time.monotonic()
    answers = [sched.get_num_new_matched_tokens(r, 0)[0] for r in requests]
    sched.build_connector_meta(SchedulerOutput.make_empty())
    return time.monotonic() - start, answers

def until_answered(requests, limit_s=10.0):
    # steps until no answer is None (vLLM skips such a request and asks again): every step's time and answers
    steps, deadline = [], time.monotonic() + limit_s
    while True:
        took, answers = step(requests)
        steps.append({"s": took, "answers": answers})
        if None not in answers or time.monotonic() > deadline:
            return steps
        time.sleep(0.002)

a, b = request("a", 8), request("b", 6)
with AgentClient(socket, shm_bytes=0) as client:  # the agent holds a's first 5 blocks and b's first 2
    client.store(sched._layout, [event_hash(h) for h in a.block_hashes[:5]], [bytes(64)] * 5)
    client.store(sched._layout, [event_hash(h) for h in b.block_hashes[:2]], [bytes(64)] * 2)
out = {"bs": bs}
if extra.get("presence", False):
    # the agent hangs: requests whose first block it never held are answered 0 at once, from its bitmap
    # (agent/presence.py), with no lookup and so no wait or failure; one whose first block it holds is asked
    os.kill(pid, signal.SIGSTOP)
    took, answers = step([request(f"n{i}", 4) for i in range(3)])
    out["never_held"] = {"s": took, "answers": answers}
    took, answers = step([a])
    out["held"] = {"s": took, "answers": answers}
    os.kill(pid, signal.SIGCONT)
    out["held_back"] = until_answered([a])
    stats = sched.get_kv_connector_stats()
    out["stats"] = stats.data if stats is not None else {}
    sched.shutdown()
    print(json.dumps(out))
    sys.exit(0)
# 1. a healthy agent: both answered, each from the start of the hashes asked
out["healthy"] = until_answered([a, b])
# 2. the agent hangs: no step waits for it; its lookups answer None, then 0 (given up at 0.5 s), and once the
#    first one times out (2 s) the circuit is open and lookups answer 0 at once
os.kill(pid, signal.SIGSTOP)
hung = [request(f"h{i}", 4) for i in range(3)]
start = time.monotonic()
out["hung"] = until_answered(hung)
out["hung_s"] = time.monotonic() - start
deadline = time.monotonic() + 5
while not sched._circuit.is_open and time.monotonic() < deadline:
    out["hung"] += until_answered([request(f"x{len(out['hung'])}", 4)])
out["open"] = sched._circuit.is_open
out["while_open"] = until_answered([a, b])
os.kill(pid, signal.SIGCONT)
deadline = time.monotonic() + 10
while sched._circuit.is_open and time.monotonic() < deadline:
    time.sleep(0.05)
# 3. back: answered again; a request that went away while asked leaves nothing behind
out["back"] = until_answered([a, b])
c = request("c", 4)
step([c])
sched.request_finished(c, [])
out["left_behind"] = sched._lookup_thread.waiting
stats = sched.get_kv_connector_stats()
out["stats"] = stats.data if stats is not None else {}
sched.shutdown()
print(json.dumps(out))
"""


def test_scheduler_lookups_never_wait_for_the_agent(tmp_path: Path, agents: list[AgentProcess],
                                                    subprocess_env: dict[str, str]) -> None:
    """Before, a lookup was a round trip inside the scheduler's step: a hung agent stopped the engine (every
    running request) for a timeout (2 s here)."""
    agent = AgentProcess(tmp_path, subprocess_env, "--dram-capacity", "4MiB")
    agents.append(agent)
    assert agent.proc is not None
    model = tmp_path / "model"
    write_model(model)
    # (the agent's bitmap off: it would answer the hung requests, whose blocks the agent never held, at once)
    out = run_in_vllm(SCHEDULER_SCRIPT, str(model), agent.socket, str(agent.proc.pid), json.dumps({"presence": False}))
    bs = out["bs"]
    for phase in ("healthy", "back"):
        assert out[phase][-1]["answers"] == [5 * bs, 2 * bs], out[phase]
    hung = out["hung"]
    assert max(s["s"] for s in hung) < 0.1, hung  # the bound is 1 ms a step; the rest is this machine's load
    assert all(answer in (None, 0) for s in hung for answer in s["answers"])
    assert hung[0]["answers"] == [None, None, None]  # not known yet: vLLM asks again next step
    assert out["hung_s"] >= 0.45  # ... until given up after 0.5 s (and no answer came)
    assert out["open"]
    assert out["while_open"][0]["answers"] == [0, 0] and out["while_open"][0]["s"] < 0.1  # no lookup at all
    assert out["left_behind"] == 0
    assert out["stats"]["lookup"].get("agent_unavailable", 0) >= 2  # timed out once, then the circuit was open
    assert out["stats"]["lookup"].get("slow", 0) >= 3  # the three hung requests given up


def test_scheduler_answers_a_block_the_agent_never_held_without_asking(
        tmp_path: Path, agents: list[AgentProcess], subprocess_env: dict[str, str]) -> None:
    """Before, every new request's lookup was a round trip through the lookup thread and the agent, and on a busy
    machine most were not answered within the step's 1 ms, so vLLM left the request for a step (issue 14 item 1: a
    saturated replica of unique prompts skipped 1.4 steps per request); a block the agent never held is now answered
    from its bitmap, in the step, whatever the agent is doing (SIGSTOPped here)."""
    agent = AgentProcess(tmp_path, subprocess_env, "--dram-capacity", "4MiB")
    agents.append(agent)
    assert agent.proc is not None
    model = tmp_path / "model"
    write_model(model)
    out = run_in_vllm(SCHEDULER_SCRIPT, str(model), agent.socket, str(agent.proc.pid), json.dumps({"presence": True}))
    bs = out["bs"]
    assert out["never_held"]["answers"] == [0, 0, 0] and out["never_held"]["s"] < 0.1, out
    assert out["held"]["answers"] == [None]  # asked, not answered: the agent is stopped
    assert out["held_back"][-1]["answers"] == [5 * bs]
    assert not any(out["stats"].get("lookup", {}).values()), out["stats"]  # nothing failed, nothing was slow


SYSTEM = " ".join(f"rule{i} keep answers short and exact" for i in range(40))  # a prefix of several blocks


def prompt(i: int, words: int) -> str:
    return SYSTEM + " " + " ".join(f"q{i}w{j} delta" for j in range(words))


def complete_all(server: EngineServer, prompts: list[str]) -> list[replica.Completion]:
    """The prompts sent at once (vLLM batches them, four at a time here, over many steps)."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: replica.complete(server, p, max_tokens=12), prompts))


@pytest.mark.vllm
def test_vllm_many_requests_over_many_steps_with_lookups_answered_late(
        weighted_model: Path, tmp_path: Path, subprocess_env: dict[str, str], servers: list[EngineServer],
        agents: list[AgentProcess]) -> None:
    """Real vLLM whose scheduler never waits for a lookup (`lookup_wait_ms: 0`: every request is first answered
    "not known yet" and asked again on a later step), eight requests at a time over many steps with loads and
    saves interleaved: six that were answered before and whose blocks come back from the agent (a shared prefix and
    their own tails) beside two new ones sharing the prefix, whose new blocks are saved in the same steps. Every
    repeated answer is identical, every loadable token is cached, and the new requests' saved blocks load back
    into identical answers."""
    agent = AgentProcess(tmp_path / "a", subprocess_env, "--block-size", str(BLOCK_SIZE))
    agents.append(agent)
    vllm = start_vllm(weighted_model, tmp_path / "logs", agent.socket, connector_extra={"lookup_wait_ms": 0})
    servers.append(vllm)
    old = [prompt(i, 10 + 17 * i) for i in range(6)]
    first = complete_all(vllm, old)
    wanted = replica.loadable_tokens(first[-1].prompt_tokens) // BLOCK_SIZE
    deadline = time.monotonic() + 60
    while agent.metric("kvgate_agent_tier_blocks", tier="dram") < wanted:
        assert time.monotonic() < deadline, "the saves never reached the agent"
        time.sleep(0.1)
    reset_prefix_cache(vllm)
    new = [prompt(10 + i, 30 + 9 * i) for i in range(2)]
    second = complete_all(vllm, [*old, *new])
    for before, again in zip(first, second[:6], strict=True):
        assert again.output == before.output
        assert again.cached == replica.loadable_tokens(again.prompt_tokens)
    assert all(c.cached > 0 for c in second[6:])  # the shared prefix, from the agent or the engine's own cache
    reset_prefix_cache(vllm)  # (refused until the saves of finished requests are done)
    third = complete_all(vllm, new)
    for before, again in zip(second[6:], third, strict=True):
        assert again.output == before.output
        assert again.cached == replica.loadable_tokens(again.prompt_tokens)
    assert "kvgate_connector_failures_total{" not in replica.metrics(vllm)  # no lookup, load or save failed


def keep_streaming(server: EngineServer, prompt_text: str, started: threading.Event, stop: threading.Event) -> None:
    """Stream greedy completions of this prompt one after another until `stop` (one may end before the caller is
    done: the tiny model decodes a whole completion in about a second); `started` is set at the first chunk."""
    body = {"model": "tiny", "prompt": prompt_text, "max_tokens": 1500, "temperature": 0, "stream": True,
            "ignore_eos": True}
    while not stop.is_set():
        request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:
                if line.startswith(b"data:"):
                    started.set()


def inter_token_latencies(server: EngineServer, over_s: float) -> tuple[float, float]:
    """(inter-token latencies vLLM observed so far, those longer than `over_s`): its own histogram, timed by the
    engine core when it produced each token -- not by a client, which a busy machine may itself not run for
    seconds (a reader thread starved 2.4 s before the agent was even stopped read a gap that was its own)."""
    count = within = None
    for line in replica.metrics(server).splitlines():
        if line.startswith("vllm:inter_token_latency_seconds_count{"):
            count = float(line.split()[-1])
        elif line.startswith("vllm:inter_token_latency_seconds_bucket{") and f'le="{over_s}"' in line:
            within = float(line.split()[-1])
    assert count is not None and within is not None, f"no inter-token latency histogram with a {over_s} s bucket"
    return count, count - within


@pytest.mark.vllm
def test_vllm_keeps_decoding_while_a_new_requests_lookup_hangs(
        weighted_model: Path, tmp_path: Path, subprocess_env: dict[str, str], servers: list[EngineServer],
        agents: list[AgentProcess]) -> None:
    """A request arrives while the agent is hung (SIGSTOPped): before, the scheduler's lookup for it waited a
    timeout (3 s here) inside the step, and every running request stopped for that long; now the running request
    keeps decoding and the new one is computed once its lookup gives up or times out."""
    agent = AgentProcess(tmp_path / "a", subprocess_env, "--block-size", str(BLOCK_SIZE))
    agents.append(agent)
    assert agent.proc is not None
    vllm = start_vllm(weighted_model, tmp_path / "logs", agent.socket,
                      # (the agent's bitmap off: it would answer the new request at once, its blocks never held)
                      connector_extra={"timeout_s": 3.0, "probe_interval_s": 0.3, "lookup_give_up_ms": 10_000,
                                       "presence": False})
    servers.append(vllm)
    replica.complete(vllm, "warm up")  # (vLLM compiles its logprobs sampler on the first request that asks: 4 s)
    started, stop = threading.Event(), threading.Event()
    # (a prompt shorter than a block: no lookup of its own, so it decodes whatever the agent does)
    runner = threading.Thread(target=keep_streaming, args=(vllm, "count with me", started, stop))
    runner.start()
    assert started.wait(120)
    tokens, stalls = inter_token_latencies(vllm, over_s=1.0)
    os.kill(agent.proc.pid, signal.SIGSTOP)
    try:
        hung_at = time.monotonic()
        late = replica.complete(vllm, prompt(99, 20))  # its lookup: none within 3 s, so computed
        answered_s = time.monotonic() - hung_at
        tokens_now, stalls_now = inter_token_latencies(vllm, over_s=1.0)
    finally:
        os.kill(agent.proc.pid, signal.SIGCONT)
        stop.set()
    runner.join(300)
    assert late.cached == 0 and answered_s >= 2.5
    assert tokens_now - tokens > 10  # the running request kept decoding while the agent was hung ...
    assert stalls_now == stalls  # ... never a step of 1 s or more; before: one of about 3 s (the lookup's timeout)


def test_a_superseded_or_abandoned_lookup_is_not_asked() -> None:
    """A request whose question changed (a local prefix hit moved its first block) or that was given up on leaves
    no lookup queued for the agent: with a hung agent each one would cost the lookup thread a whole timeout before
    the questions still wanted. The lookup thread is held on a first lookup while the others queue behind it."""
    from agent.lookups import LookupTooSlow, SchedulerLookups

    held, asked = threading.Event(), []

    def lookup(hashes: Sequence[int]) -> tuple[int, str]:
        asked.append(hashes[0])
        if hashes[0] == 0:
            assert held.wait(10)
        return len(hashes), "C" * len(hashes)

    lookups = SchedulerLookups(lookup, wait_s=0.0, give_up_s=0.2)
    try:
        assert lookups.answer("blocker", (0, 1), [0]) is None
        assert lookups.answer("moved", (0, 2), [10, 11]) is None
        assert lookups.answer("moved", (1, 1), [11]) is None  # its hit moved: the span asked is another
        assert lookups.answer("slow", (0, 1), [20]) is None
        time.sleep(0.3)
        with pytest.raises(LookupTooSlow):
            lookups.answer("slow", (0, 1), [20])
        lookups.give_up_s = 60.0  # (read at each call) the moved request's answer is collected below, however late
        held.set()
        deadline = time.monotonic() + 5
        while (answer := lookups.answer("moved", (1, 1), [11])) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert answer == (1, "C")
        assert asked == [0, 11]
        assert lookups.waiting == 1  # the blocker's answer, never collected
    finally:
        held.set()
        lookups.close()


def test_a_request_whose_question_keeps_changing_is_given_up_on_in_time() -> None:
    """A request waits for the agent at most `give_up_s` in all, however often its question changes (its local
    prefix hit grows while another request computes the same prefix, step after step): before, each new span
    started the clock again, so a request asked anew on every step, with the agent slower than a step, was told
    "not known yet" for ever -- the engine deferred it until the agent went away."""
    from agent.lookups import LookupTooSlow, SchedulerLookups

    def lookup(hashes: Sequence[int]) -> tuple[int, str]:
        time.sleep(0.05)  # slower than a step
        return len(hashes), "C" * len(hashes)

    lookups = SchedulerLookups(lookup, wait_s=0.0, give_up_s=0.3)
    try:
        began = time.monotonic()
        with pytest.raises(LookupTooSlow):
            for step in range(1_000):
                span = (step % 2, 8 - step % 2)
                assert lookups.answer("moving", span, list(range(span[0], 8))) is None
                lookups.next_step()
                time.sleep(0.01)
        assert 0.3 <= time.monotonic() - began < 5.0  # given up after its 0.3 s, not after 1,000 steps' 10 s+
        assert lookups.waiting == 0
    finally:
        lookups.close()


def test_the_lookup_thread_is_named_for_the_kernel() -> None:
    """The lookup thread carries its name as an OS thread name, so a stalled engine's failure report
    (tests/vllm_replica.thread_states) says where it waits."""
    from agent.lookups import THREAD_NAME, SchedulerLookups

    def named() -> dict[str, str]:  # thread id -> its state line
        return {line.split()[0]: line for line in replica.thread_states(os.getpid(), ("kvgate",))
                if THREAD_NAME in line}

    others = named()  # (other tests' lookup threads may still be about)
    lookups = SchedulerLookups(lambda hashes: (len(hashes), "C" * len(hashes)), wait_s=5.0, give_up_s=5.0)
    try:
        assert lookups.answer("r", (0, 1), [7]) == (1, "C")
        mine = [line for tid, line in named().items() if tid not in others]
        assert len(mine) == 1, mine
    finally:
        lookups.close()

"""`kvgate sim --replicas N` as a user runs it: one process per replica on port+i, vLLM's --kv-events-config
with ports offset per replica, one replica killed alone while the others serve, SIGTERM stops them all."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import zmq

from bench.sim.launch import SimFleet
from bench.sim.perf_model import PROFILES
from kvcore.kv_events import decode_batch
from tests.conftest import ROOT, kvgate_command


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def consecutive_free_ports(count: int, groups: int) -> list[int]:
    """`groups` bases, each with `count` consecutive free ports."""
    rng = random.Random()
    for _ in range(200):
        bases = [rng.randrange(20000, 60000) for _ in range(groups)]
        ports = [b + i for b in bases for i in range(count)]
        if len(set(ports)) == len(ports) and all(_free(p) for p in ports):
            return bases
    raise RuntimeError("no free port ranges")


def wait_healthy(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(url)


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode().split("\0")


def complete(url: str, prompt: list[int]) -> dict[str, object]:
    req = urllib.request.Request(url + "/v1/completions", method="POST",
                                 data=json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        body: dict[str, object] = json.loads(resp.read())
        return body


def test_replicas_are_processes_on_offset_ports(tiny_model_dir: Path) -> None:
    http, events, replay = consecutive_free_ports(2, 3)
    kv_events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}",
                            "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"})
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    parent = subprocess.Popen(
        [*kvgate_command("sim", "--replicas", "2", "--port", str(http), "--model-dir", str(tiny_model_dir),
                         "--served-model-name", "tiny", "--speedup", "50", "--kv-events-config", kv_events,
                         "--log-level", "warning")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ctx = zmq.Context()
    try:
        urls = [f"http://127.0.0.1:{http + i}" for i in range(2)]
        for url in urls:
            wait_healthy(url)
        kids = children(parent.pid)
        assert len(kids) == 2
        by_index = {int(cmdline(k)[cmdline(k).index("--replica-index") + 1]): k for k in kids}
        # replica 1 publishes on the configured endpoint's port + 1, with the configured topic
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(f"tcp://127.0.0.1:{events + 1}")
        time.sleep(0.3)
        complete(urls[1], list(range(50, 90)))
        assert sub.poll(5000), "no KV event from replica 1"
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv-events" and int.from_bytes(seq, "big") == 0
        assert decode_batch(payload).events
        # kill replica 1 alone: replica 0 keeps serving, the supervisor keeps running
        os.kill(by_index[1], signal.SIGKILL)
        time.sleep(0.5)
        assert parent.poll() is None
        assert complete(urls[0], list(range(50, 90)))["usage"]
        try:
            complete(urls[1], [1, 2, 3])
            raise AssertionError("replica 1 still answers after SIGKILL")
        except OSError:
            pass
        # SIGTERM to the supervisor stops the rest; its status says a replica died abnormally
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(15) == 1
        assert not os.path.exists(f"/proc/{by_index[0]}")   # stopped and reaped
    finally:
        ctx.destroy(linger=0)
        if parent.poll() is None:
            parent.kill()
            parent.wait(5)


def test_bad_flags_exit_with_a_message(tiny_model_dir: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # one request of max_model_len must fit in the cache, as vLLM checks at start-up
    proc = subprocess.run(
        kvgate_command("sim", "--model-dir", str(tiny_model_dir), "--num-gpu-blocks-override", "8",
                       "--max-model-len", "2048", "--port", "1"),
        env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "max seq len" in proc.stderr
    proc = subprocess.run(
        kvgate_command("sim", "--model-dir", str(tiny_model_dir), "--kv-events-config", "{not json"),
        env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "--kv-events-config" in proc.stderr


def test_vllm_serve_flags_are_accepted(sim_fleet: Callable[..., SimFleet]) -> None:
    """A `vllm serve` command line works unchanged; --gpu-memory-utilization sizes the cache as in vLLM."""
    fleet = sim_fleet(1, extra_args=["--enforce-eager", "--load-format", "dummy", "--dtype", "bfloat16",
                                     "--seed", "0", "--gpu-memory-utilization", "0.5", "--max-num-seqs", "8",
                                     "--trust-remote-code", "--disable-log-requests"])
    with urllib.request.urlopen(fleet.urls[0] + "/sim/blocks", timeout=5) as resp:
        state = json.loads(resp.read())
    expected = PROFILES["llama-3.1-8b-h100"].num_gpu_blocks(16, 0.5)
    assert state["num_gpu_blocks"] == expected < PROFILES["llama-3.1-8b-h100"].num_gpu_blocks(16)


def test_request_timeout_aborts_and_frees(sim_fleet: Callable[..., SimFleet]) -> None:
    fleet = sim_fleet(1, extra_args=["--request-timeout-s", "0.3"])
    url = fleet.urls[0]
    req = urllib.request.Request(url + "/v1/completions", method="POST",
                                 data=json.dumps({"model": "tiny", "prompt": [5] * 40, "max_tokens": 1000}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=10)
        raise AssertionError("a 1000-token answer at ~8 ms per step cannot finish in 0.3 s")
    except urllib.error.HTTPError as e:
        assert e.code == 504 and json.loads(e.read())["error"]["code"] == 504
    with urllib.request.urlopen(url + "/sim/blocks", timeout=5) as resp:
        state = json.loads(resp.read())
    assert state["running"] == 0 and state["num_free_blocks"] == state["num_gpu_blocks"] - 1
    assert complete(url, [1, 2, 3])["usage"]


def test_replica_processes_get_the_fleets_flags() -> None:
    """The supervisor rebuilds each replica's command line from the parsed flags (not from sys.argv)."""
    import argparse

    from bench.sim.cli import add_arguments, flags_of

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model-dir", "/m", "--replicas", "3", "--served-model-name", "a", "b",
                              "--no-enable-prefix-caching", "--enforce-eager", "--speedup", "7",
                              "--kv-events-config", '{"enable_kv_cache_events": true}', "--block-size", "32"])
    again = parser.parse_args(flags_of(args))
    assert {**vars(again), "replicas": 3} == vars(args)

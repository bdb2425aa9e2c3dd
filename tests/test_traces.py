"""Traces read as a stream: bad lines reported and skipped, order enforced, the bound from the ids alone; the
virtual-time sweep: identical results whatever --jobs, Ctrl-C keeps what finished."""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench import vsim
from bench.traces import (
    ConversationShape,
    Trace,
    TraceError,
    TraceSource,
    conversation_trace,
    expand_record,
    write_trace,
)
from bench.workloads import PromptVocabulary, ideal_hit_rate
from tests.conftest import recorded_speed


@pytest.fixture(scope="module")
def vocab(tiny_model_dir: Path) -> PromptVocabulary:
    return PromptVocabulary.from_model_dir(tiny_model_dir)


def conversations(path: Path, requests: int, seed: int = 1) -> Path:
    """A Mooncake-shaped trace: conversations whose next turn extends the last one's full blocks, a shared first
    block, lengths from a few hundred to a few thousand tokens, 0.25 s apart."""
    rng = random.Random(seed)
    sessions: list[tuple[list[int], int]] = []
    next_id = 1
    lines = []
    for i in range(requests):
        if sessions and rng.random() < 0.6:
            ids, length = sessions.pop(rng.randrange(len(sessions)))
            ids = ids[: length // 512]  # the full blocks of the last turn, then the new ones
        else:
            ids, length = [0], 0
        length += rng.randrange(100, 1500)
        while len(ids) * 512 < length:
            ids.append(next_id)
            next_id += 1
        sessions.append((ids, length))
        lines.append(row(i * 250.0, length, ids, out=rng.randrange(1, 40)))
    return write(path, lines)


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def row(ts: float, n: int, ids: list[int], out: int = 4, **extra: Any) -> str:
    return json.dumps({"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids, **extra})


def test_bad_lines_are_reported_with_their_number_and_skipped(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [
        row(0, 600, [1, 2]),
        row(5, 700, [1, 3], some_future_field={"x": 1}, model="m"),  # unknown fields are ignored
        '{"timestamp": 9, "input_length": 100, "output_le',              # truncated
        row(10, -5, [4]),                                                 # a negative length
        '{"timestamp": 11, "input_length": "many", "output_length": 1, "hash_ids": [1]}',
        "",
        "not json at all",
        row(12, 512, [1]),
    ])
    report = io.StringIO()
    trace = Trace(path, report=report)
    assert trace.scan.records == 3 and trace.scan.skipped == 4
    assert [n for n, _ in trace.scan.skipped_lines] == [3, 4, 5, 7]
    text = report.getvalue()
    for number in (3, 4, 5, 7):
        assert f"t.jsonl:{number}: skipped" in text
    assert "input_length" in text  # says what was wrong
    records = list(trace)
    assert [r.timestamp for r in records] == [0, 5, 12] and records[1].model == "m"
    assert list(trace) == records  # read again from the file, same records


def test_a_trace_going_back_in_time_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [row(0, 10, [1]), row(2000, 10, [2]), row(1500, 10, [3])])
    with pytest.raises(TraceError, match=r"t.jsonl:3: timestamp 1500 ms is earlier than line 2's 2000 ms"):
        Trace(path)
    empty = write(tmp_path / "e.jsonl", ["{}", "[]"])
    with pytest.raises(TraceError, match="no usable request"):
        Trace(empty, report=None)


def test_vsim_refuses_a_bad_trace_with_a_message_not_a_traceback(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = write(tmp_path / "t.jsonl", [row(1000, 10, [1]), row(0, 10, [2])])
    proc = subprocess.run([sys.executable, "-m", "kvgate.cli", "bench", "vsim", "--trace", str(path),
                           "--model-dir", str(tiny_model_dir), "--out", str(tmp_path / "o.json")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "t.jsonl:2: timestamp 0 ms is earlier" in proc.stderr and "Traceback" not in proc.stderr


def test_the_bound_from_ids_is_the_bound_over_the_tokens(tmp_path: Path, vocab: PromptVocabulary) -> None:
    """Partial last blocks, a block shared only up to the shorter prompt's end, twins, records short of ids,
    a block size that does not divide the ids' blocks, and a slice of the Mooncake trace."""
    path = write(tmp_path / "t.jsonl", [
        row(0, 1000, [1, 2]), row(1, 1500, [1, 2, 3]), row(2, 700, [1, 2]), row(3, 1024, [1, 2]),
        row(4, 1300, [1, 2, 3]), row(5, 2000, [1]), row(6, 2000, [1]), row(7, 511, [9]), row(8, 530, [9, 10]),
        row(9, 100, [1]),
    ])
    for trace, block_tokens in [(Trace(path), None), (Trace(conversations(tmp_path / "c.jsonl", 150)), 32)]:
        source = TraceSource(trace, vocab, block_tokens=block_tokens)
        prompts = [vocab.wire_ids(expand_record(r, vocab, block_tokens)) for r in trace]
        for block_size in (16, 24):
            exact = ideal_hit_rate(prompts, block_size)
            assert source.ideal(block_size) == exact
        assert exact.hit_tokens > 0


def sweep_command(tmp_path: Path, model_dir: Path, trace: Path, out: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvgate.cli", "bench", "vsim", "--trace", str(trace), "--model-dir",
            str(model_dir), "--replicas", "2", "--gpu-blocks", "100", "--block-tokens", "64", "--no-progress",
            "--out", str(tmp_path / out), *extra]


@pytest.mark.timeout(300)
def test_jobs_side_by_side_give_the_results_of_one_at_a_time(tmp_path: Path, tiny_model_dir: Path) -> None:
    trace = conversations(tmp_path / "c.jsonl", 120)
    runs = {}
    for jobs in (1, 2):
        cmd = sweep_command(tmp_path, tiny_model_dir, trace, f"j{jobs}.json", "--limit", "120",
                            "--strategies", "round_robin,kv", "--tiers", "on", "--jobs", str(jobs))
        subprocess.run(cmd, check=True, timeout=240, capture_output=True)
        runs[jobs] = orjson.loads((tmp_path / f"j{jobs}.json").read_bytes())

    def comparable(result: dict[str, Any]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k not in ("wall_s", "cpu_s", "peak_rss_mb")}
                for r in result["results"]]

    assert len(runs[1]["results"]) == 2 and not runs[1]["interrupted"]
    assert comparable(runs[1]) == comparable(runs[2])
    assert all(r["completed"] == 120 for r in runs[2]["results"])
    assert 0 < runs[2]["peak_total_pss_mb"] < runs[2]["peak_total_rss_mb"]  # shared pages counted once, not thrice
    assert recorded_speed(runs[1]["machine_speed"]) and recorded_speed(runs[2]["machine_speed"])


@pytest.mark.timeout(300)
def test_ctrl_c_writes_what_finished(tmp_path: Path, tiny_model_dir: Path) -> None:
    trace = conversations(tmp_path / "c.jsonl", 400)
    cmd = sweep_command(tmp_path, tiny_model_dir, trace, "c.json", "--limit", "400", "--strategies",
                        "round_robin,kv,kv,kv", "--tiers", "off", "--jobs", "1")
    # SIGINT as in a terminal's foreground job: a shell's background job (a CI runner's `... &`) starts with
    # SIGINT ignored, and a child inherits that, so Ctrl-C would never reach the sweep
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            if "round_robin" in line:  # the first configuration finished
                break
            assert time.monotonic() < deadline
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130
    result = orjson.loads((tmp_path / "c.json").read_bytes())
    assert result["interrupted"] is True
    assert [r["strategy"] for r in result["results"]][:1] == ["round_robin"]
    assert len(result["results"]) < 4 and len(result["unfinished"]) == 4 - len(result["results"])


def test_only_requests_in_flight_hold_prompts(tmp_path: Path, vocab: PromptVocabulary) -> None:
    """The trace is expanded as requests arrive: the simulation never holds more prompts than it has in flight."""
    path = write(tmp_path / "t.jsonl", [row(i * 1000.0, 600, [i % 3, 100 + i], out=2) for i in range(50)])
    taken = []
    source = TraceSource(Trace(path), vocab)

    class Counting:
        name, count, longest, timed = "t", source.count, source.longest, True
        params: dict[str, object] = {}

        def __iter__(self):  # type: ignore[no-untyped-def]
            for arrival in source:
                taken.append(sim.now)
                yield arrival

        def ideal(self, block_size: int):  # type: ignore[no-untyped-def]
            return source.ideal(block_size)

    sim = vsim.FleetSimulation(Counting(), strategy="round_robin", replicas=2, gpu_blocks=100)
    result = sim.run()
    assert result["completed"] == 50
    # each request is taken from the trace when the one before it arrives, not all at the start
    assert taken[10] >= 9.0 and taken[-1] >= 48.0


def test_the_synthetic_conversation_trace_has_the_size_it_claims(tmp_path: Path, vocab: PromptVocabulary) -> None:
    """`kvgate bench trace`: by default the size of Mooncake's conversation trace (12,031 requests, ~145 M prompt
    tokens, one hour); turns extend their conversation's history, so a single cache would hit most of it."""
    path = tmp_path / "conv.jsonl"
    done = subprocess.run([sys.executable, "-m", "kvgate.cli", "bench", "trace", "--out", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    trace = Trace(path, report=None)
    assert len(trace) == 12_031 and trace.scan.skipped == 0
    assert 140e6 < trace.scan.prompt_tokens < 155e6 and trace.scan.duration_s == pytest.approx(3600, abs=1)
    small = tmp_path / "small.jsonl"
    write_trace(small, conversation_trace(ConversationShape(requests=400, duration_s=60.0)))
    assert 0.5 < TraceSource(Trace(small), vocab, block_tokens=32).ideal(16).hit_rate < 0.95


def test_files_that_are_not_traces_are_refused_with_what_they_are(tmp_path: Path) -> None:
    plain = write(tmp_path / "plain.jsonl", [row(0, 600, [1, 2]), row(5, 700, [1, 3])])
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    csv = write(tmp_path / "t.csv", ["timestamp,input_length,output_length", "0,100,4"])
    array = write(tmp_path / "t.json", [json.dumps([json.loads(row(0, 600, [1]))])])
    cases = {gz: "gzip-compressed; a trace is JSON lines (gunzip it first)", tmp_path: "a directory, not a trace",
             tmp_path / "absent.jsonl": "no such trace file", csv: "no usable request", array: "no usable request"}
    for path, message in cases.items():
        report = io.StringIO()
        with pytest.raises(TraceError, match=re.escape(message)):
            Trace(path, report=report)
    report = io.StringIO()
    with pytest.raises(TraceError):
        Trace(array, report=report)
    assert "t.json:1: skipped, Expected `object`, got `array`" in report.getvalue()
    # a trace without the gateway's timings cannot be calibrated: said so, not a traceback
    proc = subprocess.run([sys.executable, "-m", "kvgate.cli", "bench", "calibrate", "--trace", str(plain),
                           "--out", str(tmp_path / "p.json")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "no request in it has the timings a fit needs" in proc.stderr and "--record-trace" in proc.stderr

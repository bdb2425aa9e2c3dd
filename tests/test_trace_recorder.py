"""The trace recorder on its own: ids keyed and renumbered per file, arrival order, rotation by size and age, a
full disk and a full queue drop records (counted, logged once) and never raise."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from bench.traces import Trace
from router.block_keys import block_keys, root_key
from router.trace_recorder import Finished, TraceRecorder

BS = 16


def recorder(path: Path, **kwargs: object) -> TraceRecorder:
    settings: dict[str, object] = {"block_size": BS, "block_tokens": 32, "secret": b"s" * 16, "max_bytes": 1 << 20,
                                   "max_age_s": 3600.0, "registry": CollectorRegistry()}
    settings.update(kwargs)
    return TraceRecorder(path, **settings)  # type: ignore[arg-type]


def finished(tokens: list[int], arrived: float, namespace: str | None = None, **kwargs: object) -> Finished:
    keys = block_keys(tokens, BS, root_key("m", None, namespace))
    return Finished(arrived=arrived, model="m", namespace=namespace, prompt_tokens=len(tokens), block_keys=keys,
                    tail_tokens=tokens[len(keys) * BS:], strategy="kv", **kwargs)  # type: ignore[arg-type]


def metric(r: TraceRecorder, name: str, **labels: str) -> float:
    return float(r.metrics.registry.get_sample_value(name, labels or None) or 0.0)


def test_lines_name_blocks_by_small_ids_in_arrival_order(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    r = recorder(path)
    r.start()
    a = list(range(100, 200))          # 100 tokens: 3 full 32-token ids and a partial one
    b = a[:64] + list(range(500, 540))  # shares the first two ids with a, then its own
    seqs = [r.begin() for _ in range(4)]
    # finished out of order: the lines still come in arrival order
    r.finish(seqs[1], finished(b, 10.25, worker="w1", status=200, ttfb_s=0.05, duration_s=0.2, output_tokens=7,
                               cached_tokens=64, predicted_cached_tokens=48))
    r.finish(seqs[3], finished(a, 10.75, namespace="tenant-x"))
    r.finish(seqs[2], None)  # ended before it was routed: no line, and it holds nothing back
    assert not path.read_bytes()  # the first arrival has not finished: nothing may be written yet
    r.finish(seqs[0], finished(a, 10.0, worker="w0", status=200))
    r.close()
    records = list(Trace(path))
    assert [rec.timestamp for rec in records] == [0.0, 250.0, 750.0]
    first, second, third = records
    assert first.hash_ids == [0, 1, 2, 3] and first.input_length == 100 and first.block_tokens == 32
    assert second.hash_ids[:2] == [0, 1] and second.hash_ids[2:] == [4, 5]  # shared prefix, then new ids
    assert second.cached_tokens == 64 and second.predicted_cached_tokens == 48 and second.output_length == 7
    assert second.ttfb_ms == 50.0 and second.duration_ms == 200.0 and second.worker == "w1"
    assert third.tenant == 0 and not set(third.hash_ids) & set(first.hash_ids)  # another namespace, other blocks
    text = path.read_text()
    assert "tenant-x" not in text and "150" not in text  # no namespace, no token id
    assert metric(r, "kvgate_trace_records_written_total") == 3


def test_the_ids_depend_on_the_secret_only_through_their_hashes(tmp_path: Path) -> None:
    """Two gateways with different secrets write the same small ids for the same traffic: the keyed hashes never
    leave the process."""
    lines = []
    for name, secret in (("a", b"1" * 16), ("b", b"2" * 16)):
        r = recorder(tmp_path / f"{name}.jsonl", secret=secret)
        r.start()
        for i, tokens in enumerate((list(range(64)), list(range(32)) + [7] * 40)):
            r.finish(r.begin(), finished(tokens, float(i)))
        r.close()
        lines.append([rec.hash_ids for rec in Trace(tmp_path / f"{name}.jsonl")])
        assert r._mac(b"x") != recorder(tmp_path / "c.jsonl", secret=b"3" * 16)._mac(b"x")
    assert lines[0] == lines[1] == [[0, 1], [0, 2, 3]]


def test_files_rotate_by_size_and_age_and_start_again(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    r = recorder(path, max_bytes=600)
    r.start()
    tokens = list(range(64))
    for i in range(12):
        r.finish(r.begin(), finished(tokens, 100.0 + i))
        time.sleep(0.01)  # several writes, so that the size is checked between them
    r.close()
    rotated = sorted(tmp_path.glob("trace.*.jsonl"))
    assert rotated and path.exists()
    files = [*rotated, path]
    seen = 0
    for f in files:
        records = list(Trace(f))
        seen += len(records)
        assert records[0].timestamp == 0.0 and records[0].hash_ids == [0, 1]  # ids and time start again
    assert seen == 12
    assert metric(r, "kvgate_trace_files_total") == len(files)

    aged = tmp_path / "aged.jsonl"
    r = recorder(aged, max_age_s=0.2)
    r.start()
    r.finish(r.begin(), finished(tokens, 1.0))
    time.sleep(0.4)
    r.finish(r.begin(), finished(tokens, 2.0))
    r.close()
    assert len(list(tmp_path.glob("aged.*.jsonl"))) == 1 and len(list(Trace(aged))) == 1


def test_a_full_disk_drops_records_logs_once_and_raises_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """/dev/full: every write fails with ENOSPC, as on a full disk."""
    r = recorder(Path("/dev/full"))
    r.start()
    with caplog.at_level(logging.ERROR, logger="router.trace_recorder"):
        for i in range(50):
            r.finish(r.begin(), finished(list(range(40)), float(i)))
            if i % 10 == 0:
                time.sleep(0.02)  # several failing writes, not one
        r.close()
    assert metric(r, "kvgate_trace_records_dropped_total", reason="write_error") == 50
    assert metric(r, "kvgate_trace_records_written_total") == 0
    errors = [rec for rec in caplog.records if "cannot write /dev/full" in rec.getMessage()]
    assert len(errors) == 1 and "No space left" in errors[0].getMessage()


def test_a_writer_that_falls_behind_drops_records_rather_than_waiting(tmp_path: Path) -> None:
    r = recorder(tmp_path / "t.jsonl", queue_records=5)  # the writer is never started: nothing drains the queue
    started = time.perf_counter()
    for i in range(20):
        r.finish(r.begin(), finished(list(range(40)), float(i)))
    assert time.perf_counter() - started < 0.5
    assert metric(r, "kvgate_trace_records_dropped_total", reason="queue_full") == 15


def test_block_tokens_must_be_whole_blocks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of block_size"):
        recorder(tmp_path / "t.jsonl", block_tokens=24)

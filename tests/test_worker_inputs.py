"""What the gateway takes in from workers and their event publishers, beyond the answers it relays: hostile values
must not grow its memory without bound nor leave state behind (see also test_abuse.py, test_kv_events_fuzz.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import resource
import statistics
import threading
import time
from pathlib import Path

import aiohttp
import msgspec
import orjson
import pytest

from bench.procs import free_port
from kvcore.kv_events import GPU, AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KvEventPublisher
from router.kv_apply import IDENTITY_MODELS, Applied, KvEventApplier
from router.kv_index import InMemoryKvIndex
from router.kv_transport import EventSource, ZmqEventTransport
from router.metrics import GatewayMetrics
from router.pool import Worker, parse_cache_config, parse_load_gauges
from tests.abuse_servers import listing_worker, raw_worker
from tests.conftest import eventually, running_gateway, running_standin
from tests.test_kv_events_in import (
    BS,
    KEYS,
    TOKENS,
    WORKER,
    _two_free_ports,
    connected,
    held,
    hub_and_publisher,
    metric,
    stored,
)


def _series_of(metrics: GatewayMetrics, url: str) -> list[str]:
    """Every sample whose `worker` label names `url` (or one of its data-parallel ranks' caches)."""
    return [f"{sample.name}{sample.labels}" for family in metrics.registry.collect() for sample in family.samples
            if sample.labels.get("worker", "").split("#dp")[0] == url]


async def test_a_removed_worker_leaves_no_metric_series(http: aiohttp.ClientSession) -> None:
    """Every label set naming a worker goes with it: a fleet whose workers come and go (discovery on a cluster
    whose pods get new addresses, workers added and removed by /admin/workers) otherwise grows the gateway's
    metrics without bound (the requests counter, ejections and the KV event counters kept each removed worker's
    series forever)."""
    events, replay = _two_free_ports(), _two_free_ports()
    publisher = KvEventPublisher(f"tcp://*:{events}", f"tcp://*:{replay}", data_parallel_rank=None)
    await publisher.start()
    try:
        async with running_standin() as worker, running_gateway([], strategy="kv", block_size=BS) as gw:
            spec = {"url": worker.url, "events": f"tcp://127.0.0.1:{events}", "replay": f"tcp://127.0.0.1:{replay}"}
            metrics = gw.gateway.metrics
            for _ in range(3):  # added and removed again and again, as discovery churns
                async with http.post(gw.url + "/admin/workers", json=spec) as resp:
                    assert resp.status == 201, await resp.text()
                hub = gw.gateway.kv_events
                assert hub is not None
                deadline = time.monotonic() + 10
                while not hub.trusted(worker.url):
                    assert time.monotonic() < deadline, "the worker's events never made its picture whole"
                    publisher.publish([BlockStored(block_hashes=[1], token_ids=[1, 2, 3, 4], block_size=BS)])
                    await asyncio.sleep(0.05)
                publisher.publish([BlockStored(block_hashes=[2], parent_block_hash=99, token_ids=[5, 6, 7, 8],
                                               block_size=BS)])  # an unknown parent: counted unmapped
                publisher.publish([BlockStored(block_hashes=[3], token_ids=[1] * 8, block_size=8)])  # rejected
                publisher.publish([AllBlocksCleared()])  # whole again (the next round replays all of this)
                async with http.post(gw.url + "/v1/completions",
                                     json={"model": "tiny", "prompt": "hello", "max_tokens": 1}) as resp:
                    assert resp.status == 200
                metrics.ejections.labels(worker.url).inc()  # as a failed probe would count it
                await eventually(lambda: all(any(what in s for s in _series_of(metrics, worker.url))
                                               for what in ("unmapped", "mismatches")))
                assert any("kvgate_requests" in s for s in _series_of(metrics, worker.url))
                async with http.delete(gw.url + "/admin/workers", params={"url": worker.url}) as resp:
                    assert resp.status == 202
                await eventually(lambda: not gw.gateway.pool.all())
                assert _series_of(metrics, worker.url) == []
                assert not hub.applier._warned  # nor its warnings (one per source and reason, kept to warn once)
                async with http.get(gw.url + "/metrics") as resp:
                    assert worker.url not in await resp.text()
    finally:
        await publisher.close()


def test_what_a_source_holds_is_bounded_as_the_index_is() -> None:
    """The index keeps at most `max_entries` (block, worker) entries and drops the oldest beyond; what each source
    says it holds (engine hash -> key, kept to undo its removals) was unbounded: an engine that announced blocks
    and never removed them (a buggy or hostile one; or one announcing the same content under ever new hashes, which
    the index holds as one entry) grew the gateway's memory for as long as it ran. Now a source's holdings on a
    tier are kept to the index's bound the same way, oldest first."""
    index = InMemoryKvIndex(max_entries=1000)
    applier = KvEventApplier(index, GatewayMetrics(), lambda url: "tiny", block_size=BS)
    engine = EventSource(WORKER, "tcp://127.0.0.1:9")
    for batch in range(50):  # 100 blocks of other content each, 5000 in all, none removed
        hashes: list[BlockHash] = list(range(batch * 100, batch * 100 + 100))
        applier.apply(engine, [BlockStored(block_hashes=hashes, token_ids=[batch * 1000 + t for t in range(400)],
                                           block_size=BS)])
    assert index.entries() <= 1000
    assert 0 < len(applier.engine_hashes(WORKER, GPU)) <= 1000
    newest = set(range(4900, 5000))
    assert newest <= applier.engine_hashes(WORKER, GPU)  # the newest kept, and removable
    applier.apply(engine, [BlockRemoved(block_hashes=sorted(newest))])
    assert not newest & applier.engine_hashes(WORKER, GPU)
    for batch in range(50, 100):  # the same content under ever new hashes: one entry in the index
        applier.apply(engine, [BlockStored(block_hashes=list(range(batch * 100, batch * 100 + 100)),
                                           token_ids=list(range(400)), block_size=BS)])
    assert len(applier.engine_hashes(WORKER, GPU)) <= 1000
    assert applier.engine_hashes(WORKER, GPU) <= set(range(5000, 10000))


async def test_a_long_model_listing_costs_the_request_path_nothing_per_model() -> None:
    """A worker listing 100,000 models (a multi-LoRA engine, or a hostile one): the base model its KV events and
    requests are keyed under was found by a scan of every card on each call (per request routed and per event
    batch: about 10 ms each at 100,000 cards); it is found once per listing now. Timed against a one-card worker
    in the same run (a ratio, for a loaded machine)."""
    cards = [{"id": "tiny", "object": "model"}] + [
        {"id": f"adapter-{i}", "object": "model", "parent": "tiny"} for i in range(100_000)]
    async with listing_worker(free_port()) as many, listing_worker(free_port()) as one:
        many.models = {"object": "list", "data": cards}
        async with running_gateway([many.url, one.url], models_refresh_s=0.2) as gw:
            pool = gw.gateway.pool
            await eventually(lambda: all(w.models for w in pool.all()), timeout=30)
            big, small = pool.get(many.url), pool.get(one.url)
            assert big is not None and small is not None
            assert big.key_names("adapter-7") == ("tiny", "adapter-7") and big.key_names("tiny") == ("tiny", None)

            def timed(worker: Worker) -> float:
                began = time.perf_counter()
                for _ in range(100):
                    worker.key_names("tiny")
                    assert worker.base_model == "tiny"
                return time.perf_counter() - began

            ratios = []
            for _ in range(3):
                ratios.append(timed(big) / timed(small))
            assert min(ratios) < 10, ratios
            # GET /v1/models is made once per set of listings (sorting and serialising 100,000 cards: 87 ms), and
            # says the same as before: every card by id
            async with aiohttp.ClientSession() as http, http.get(gw.url + "/v1/models") as resp:
                listed_models = orjson.loads(await resp.read())
            assert [c["id"] for c in listed_models["data"]] == sorted(c["id"] for c in cards)
            assert pool.models_listing() is pool.models_listing()
            # an unchanged listing is not parsed again at each refresh (16 MiB of JSON: a stall of its own)
            listed, fetched = big.model_cards, big.models_fetched_at
            await eventually(lambda: big.models_fetched_at > fetched, timeout=10)
            assert big.model_cards is listed
            many.models = {"object": "list", "data": cards[:10]}  # a changed one is
            await eventually(lambda: len(big.models) == 10, timeout=10)
            assert len(orjson.loads(pool.models_listing())["data"]) == 10


async def test_a_malformed_event_of_a_known_type_makes_the_picture_partial() -> None:
    """An event type this version does not know is skipped (a newer vLLM may add some); a BlockRemoved or
    BlockStored with a field of the wrong type is an event no engine could send, and skipping it loses what it
    said: a removal skipped so left a block in the index, and the worker's picture still counted as complete
    (routed by it). Now it is counted as invalid and the picture is partial, as for every other invalid event."""
    async with hub_and_publisher() as (hub, publisher, metrics):
        hub.watch([publisher.source])
        await connected(hub, publisher)
        await publisher.send([stored([1], TOKENS[:4])])
        await eventually(lambda: held(hub) == {(KEYS[0], GPU)})
        assert hub.trusted(WORKER)
        future = msgspec.msgpack.encode({"type": "BlockMigrated", "block_hashes": [1]})
        await publisher.send_encoded(msgspec.msgpack.encode([1.0, [msgspec.Raw(future)], None]))
        await eventually(lambda: metric(metrics, "kvgate_kv_event_decode_errors_total", worker=WORKER,
                                        reason="unknown_event") == 1)
        assert hub.trusted(WORKER)  # an unknown type: skipped, nothing lost that this version could apply
        removal = msgspec.msgpack.encode({"type": "BlockRemoved", "block_hashes": [1], "medium": 5})
        await publisher.send_encoded(msgspec.msgpack.encode([1.0, [msgspec.Raw(removal)], None]))
        await eventually(lambda: metric(metrics, "kvgate_kv_event_decode_errors_total", worker=WORKER,
                                        reason="invalid_event") == 1)
        assert not hub.trusted(WORKER)


async def test_model_ids_reach_the_log_escaped_and_bounded(caplog: pytest.LogCaptureFixture) -> None:
    """A worker's model ids are its own strings: one with a newline wrote a forged line into the gateway's log
    ("worker ... is healthy (models: ...)"), and a listing of 100,000 ids a line of megabytes each time the worker
    came back. They are logged escaped now, and a few of them at most."""
    forged = "a\n2026-01-01 ERROR forged line"  # sorted first: among the few shown
    cards = [{"id": forged}] + [{"id": f"adapter-{i:06d}"} for i in range(100_000)]
    async with listing_worker(free_port()) as worker:
        worker.models = {"object": "list", "data": cards}
        with caplog.at_level(logging.INFO, logger="router.pool"):
            async with running_gateway([worker.url]) as gw:
                await eventually(lambda: gw.gateway.pool.all()[0].healthy, timeout=30)
    lines = [r.getMessage() for r in caplog.records if "is healthy" in r.getMessage()]
    assert lines
    for line in lines:
        assert "\n" not in line and len(line) < 2000, line[:300]
        assert "100001 models" in line
        assert repr(forged)[1:-1] in line  # escaped, still readable


async def test_a_worker_url_with_control_characters_is_refused(http: aiohttp.ClientSession) -> None:
    """A worker URL is a label value and is logged: one with a newline (Python's URL parser drops it when it
    connects, so the worker even answered) forged log lines from then on. Refused as any other bad URL is."""
    async with running_gateway([]) as gw:
        for bad in ("http://127.0.0.1\n2026-01-01 ERROR forged:1", "http://127.0.0.1:1/\x1b[2J", "http://a\tb:1"):
            async with http.post(gw.url + "/admin/workers", json={"url": bad}) as resp:
                body = await resp.json()
                assert resp.status == 400 and body["error"]["code"] == "invalid_worker", (bad, body)
        assert gw.gateway.pool.all() == []


def test_one_large_event_is_applied_in_even_slices() -> None:
    """An event of 65,536 blocks of 16 tokens (the most one may name; 1.2 MB on the wire) is applied in slices
    with the event loop let run between them; its first slice was 35-55x the median one (a min() and max()
    over its million token ids, about 60 ms here, before the first slice). Measured as the longest slice against
    the median one, best of three (a ratio, for a loaded machine); a token id out of range is still refused."""
    blocks, size = 65_536, 16
    rng = random.Random(7)
    ratios = []
    for _ in range(3):
        applier = KvEventApplier(InMemoryKvIndex(), GatewayMetrics(), lambda url: "tiny", block_size=size)
        event = BlockStored(block_hashes=list(range(blocks)), block_size=size,
                            token_ids=[rng.randrange(2**31) for _ in range(blocks * size)])
        slices = []
        began = time.perf_counter()
        for _ in applier.steps(EventSource(WORKER, "tcp://127.0.0.1:9"), [event], Applied()):
            now = time.perf_counter()
            slices.append(now - began)
            began = now
        slices.append(time.perf_counter() - began)
        assert len(applier.engine_hashes(WORKER, GPU)) == blocks
        ratios.append(max(slices) / statistics.median(slices))
    assert min(ratios) < 12, ratios  # 35-55 before, 3-5 after (dict resizes make some slices longer)
    applier = KvEventApplier(InMemoryKvIndex(), GatewayMetrics(), lambda url: "tiny", block_size=size)
    tokens = list(range(blocks * size))
    tokens[-1] = 2**32
    assert applier.apply(EventSource(WORKER, "tcp://127.0.0.1:9"),
                         [BlockStored(block_hashes=list(range(blocks)), block_size=size, token_ids=tokens)]).rejected


async def test_a_replay_with_a_hole_does_not_count_as_repairing_the_gap() -> None:
    """A gap of three batches, and a replay that answers the first and the last of them but not the one between
    (a publisher's buffer is contiguous; one that is not is broken): the gap counted as repaired, the batch in the
    hole was lost silently and the worker was still routed by its picture as complete. A replay must cover every
    batch of the gap, in order."""
    async with hub_and_publisher() as (hub, publisher, metrics):
        hub.watch([publisher.source])
        await connected(hub, publisher)
        await publisher.send([stored([1], TOKENS[:4])])
        await eventually(lambda: held(hub) == {(KEYS[0], GPU)})
        await publisher.send([stored([2], TOKENS[4:8], parent=1)], deliver=False)
        hole = await publisher.send([BlockRemoved(block_hashes=[1])], deliver=False)
        await publisher.send([stored([3], TOKENS[8:12], parent=2)], deliver=False)
        del publisher.buffer[hole]
        await publisher.send([stored([7], [1, 2, 3, 4])])
        await eventually(lambda: metric(metrics, "kvgate_kv_state_resets_total", worker=WORKER, reason="gap") == 1)
        assert metric(metrics, "kvgate_kv_event_replays_total", worker=WORKER, outcome="repaired") == 0
        assert not hub.trusted(WORKER)


async def test_a_cache_size_no_engine_could_have_does_not_stop_routing(http: aiohttp.ClientSession) -> None:
    """`vllm:cache_config_info` with a num_gpu_blocks of 401 digits (Python reads it as an int; the ttft strategy
    multiplies it by the cache usage, a float): every request routed while the gateway held blocks there was a 500
    (int too large to convert to float). A cache size past any GPU's (2^40 blocks) is not read, as a non-positive
    one is not."""
    body = orjson.dumps({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "a"}]})

    async def slow(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.3)  # requests overlap: the gateway holds blocks on the worker
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                     + body)

    page = (b'vllm:cache_config_info{block_size="16",num_gpu_blocks="1' + b"0" * 400 + b'"} 1.0\n'
            b"vllm:kv_cache_usage_perc 0.5\n")
    assert parse_cache_config(page.decode()) is None
    assert parse_cache_config('vllm:cache_config_info{block_size="16",num_gpu_blocks="27000"} 1.0') == (27000, 16)
    async with raw_worker(slow, metrics=page) as odd, running_gateway([odd], strategy="ttft") as gw:
        worker = gw.gateway.pool.get(odd)
        assert worker is not None
        await eventually(lambda: worker.healthy and worker.load_scraped_at > 0)

        async def one(i: int) -> int:
            async with http.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": f"{i} " * 50}) as resp:
                await resp.read()
                return resp.status

        assert await asyncio.gather(*(one(i) for i in range(6))) == [200] * 6


def test_a_large_metrics_page_is_read_at_c_speed() -> None:
    """A worker's /metrics page is scraped every second (up to 16 MiB of it), on the event loop: the load gauges
    and the cache size were found by a Python loop over every line of it (22 ms for 4 MiB of vLLM histogram lines,
    ~170x one pass over the page in C for short lines); each is searched for in the page now. Timed against
    counting the page's lines (a ratio, best of three, for a loaded machine)."""
    line = "vllm:g 1\n"  # short lines: what a loop over lines costs most on
    text = line * (4 * 2**20 // len(line)) + (
        '# HELP vllm:num_requests_running x\nvllm:num_requests_running{engine="0"} 3\n'
        'vllm:num_requests_running{engine="1"} 4\nvllm:num_requests_running_more 100\n'
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="27000"} 1.0')
    ratios = []
    for _ in range(3):
        began = time.perf_counter()
        values, cache = parse_load_gauges(text), parse_cache_config(text)
        parsed = time.perf_counter() - began
        began = time.perf_counter()
        text.count("\n")  # one pass over the page in C
        ratios.append(parsed / (time.perf_counter() - began))
        assert values["running"] == 7 and values["waiting"] == 0 and cache == (27000, 16)
    assert min(ratios) < 40, ratios  # about 170 before, 2-11 after


async def test_a_16_mib_metrics_page_is_read_with_the_event_loop_let_in(tmp_path: Path) -> None:
    """A worker's /metrics page (up to 16 MiB of it) was joined, decoded and searched in one go, every scrape:
    47-52 ms of the gateway's event loop here for 16 MiB (a data-parallel engine's page carries a sample per rank:
    megabytes are legal). It is read 1 MiB at a time as it arrives now, the loop let in between. The page comes
    from another process (Python's http.server), so that the loop thread's CPU time per turn measures the
    gateway's reading only."""
    import subprocess
    import sys

    from bench.procs import stop, wait_http
    from tests.abuse_servers import MODELS

    line = 'vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3",model_name="tiny"} 1234.0\n'
    page = line * (16 * 2**20 // len(line) - 2) + (
        'vllm:num_requests_running{engine="0"} 3\nvllm:num_requests_running{engine="1"} 4\n'
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="27000"} 1.0\n')
    (tmp_path / "metrics").write_text(page)
    (tmp_path / "health").write_text("")
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_bytes(MODELS)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory",
                               str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        await asyncio.to_thread(wait_http, url + "/health", 30, server)
        async with running_gateway([url], metrics_interval_s=0.25) as gw:
            worker = gw.gateway.pool.get(url)
            assert worker is not None
            await eventually(lambda: worker.running == 7 and worker.kv_blocks == 27000, timeout=30)
            scraped = worker.load_scraped_at
            longest = 0.0
            last = time.thread_time()
            until = time.monotonic() + 3
            while time.monotonic() < until:  # a few scrapes of the page
                await asyncio.sleep(0)
                now = time.thread_time()
                longest = max(longest, now - last)
                last = now
            assert worker.load_scraped_at > scraped
        print(f"longest loop turn while 16 MiB pages were read: {longest * 1e3:.1f} ms of CPU")
        assert longest < 0.015, longest  # (47-52 ms before)
    finally:
        stop(server)


def test_a_metrics_line_of_megabytes_is_not_joined_again_at_every_chunk() -> None:
    """A /metrics page is read 1 MiB at a time, cut at line ends. A page whose line ends are megabytes apart (a
    comment line of 16 MiB, a page with no line end at all: a broken or hostile worker) joined all it had kept and
    searched it for a line end at every chunk that arrived: quadratic, 25 times the CPU of 16 MiB of samples for 16
    KiB chunks, at every scrape. Each byte is joined once now (CPU ratios, the two pages alternated)."""
    from router.pool import PageReader

    line = b'vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3",model_name="tiny"} 1234.0\n'
    samples = line * (16 * 2**20 // len(line) - 1) + b"vllm:num_requests_running 7\n"
    comment = b"#" + b"x" * (len(samples) - 30) + b"\nvllm:num_requests_running 7\n"

    def cpu(page: bytes) -> float:
        reader = PageReader()
        began = time.process_time()
        for at in range(0, len(page), 16 * 2**10):
            reader.feed(page[at:at + 16 * 2**10])
        values, _ = reader.result()
        assert values["running"] == 7
        return time.process_time() - began

    ratios = []
    for _ in range(3):
        base = cpu(samples)
        ratios.append(cpu(comment) / max(base, 1e-3))
    assert min(ratios) < 5, ratios  # 25-30 before, about 2 after


def test_a_metrics_page_without_line_ends_is_not_kept_whole() -> None:
    """A /metrics page is read 1 MiB at a time, cut at line ends; bytes after the last line end wait for theirs. A
    page with no line end (or a line of megabytes: a broken or hostile worker) was kept whole, up to the 16 MiB
    bound, and decoded and searched in one go at its end: 39 ms of the event loop here. A line longer than any a
    vLLM page has is skipped as it arrives now, and the samples after it are still read."""
    from router.pool import MAX_LINE_BYTES, PAGE_SLICE_BYTES, PageReader

    class Recording(PageReader):
        def __init__(self) -> None:
            super().__init__()
            self.held: list[int] = []

        def _read(self, data: bytes | memoryview) -> None:
            self.held.append(len(data))
            super()._read(data)

    chunk = 64 * 2**10
    long_line = b"#" + b"x" * (16 * 2**20)
    for page in (long_line + b"\nvllm:num_requests_running 7\n", long_line):
        reader = Recording()
        most = 0
        for at in range(0, len(page), chunk):
            reader.feed(page[at:at + chunk])
            most = max(most, reader._size)
        values, _ = reader.result()
        assert values["running"] == (7 if page is not long_line else 0)
        assert most < PAGE_SLICE_BYTES + MAX_LINE_BYTES, most
        assert max(reader.held, default=0) < PAGE_SLICE_BYTES, reader.held  # (16 MiB in one read before)
    # a line that ends within the bound is read, whatever the chunks' sizes
    reader = Recording()
    line = b'vllm:cache_config_info{block_size="16",num_gpu_blocks="27000",pad="' + b"y" * 30_000 + b'"} 1.0\n'
    page = line * 40 + b"vllm:num_requests_running 3\n"
    for at in range(0, len(page), 4096):
        reader.feed(page[at:at + 4096])
    values, cache = reader.result()
    assert values["running"] == 3 and cache == (27000, 16)


def test_content_identity_is_kept_for_a_bounded_number_of_models() -> None:
    """Content identity (engine hash -> gateway key) is kept per model, the newest `identity_blocks` of each; a
    worker whose listing names another base model at every refresh (a hostile one) made a new model's names each
    time, and none was ever dropped. The names of the models used least recently go beyond `IDENTITY_MODELS`."""
    models = iter(f"model-{i}" for i in range(10_000))
    current = ["tiny"]
    applier = KvEventApplier(InMemoryKvIndex(), GatewayMetrics(), lambda url: current[0], block_size=BS)
    engine = EventSource(WORKER, "tcp://127.0.0.1:9")
    for batch in range(IDENTITY_MODELS * 4):
        current[0] = next(models)
        applier.apply(engine, [AllBlocksCleared(), BlockStored(block_hashes=list(range(10)), block_size=BS,
                                                               token_ids=list(range(batch, batch + 40)))])
    assert len(applier.identity._by_model) <= IDENTITY_MODELS
    assert len(applier.identity) <= IDENTITY_MODELS * 10
    assert applier.identity.get(current[0], 9) is not None  # the newest model's names are kept


async def test_hundreds_of_event_sources_each_keep_their_subscription() -> None:
    """Each subscription takes three ZMQ sockets (the SUB, its monitor and the monitor's pair) and a ZMQ context
    allows 1023 by default: past ~340 sources (170 workers with an engine and a tier agent each) creating a socket
    raised outside the subscription's retry loop, and the subscription's task ended silently for good (its worker
    routed approximately forever). Every subscription stays, and hears its publisher."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    heard: list[list[bytes]] = []

    class Receiver:
        async def opened(self) -> None:
            pass

        async def disconnected(self) -> None:
            pass

        async def reconnected(self) -> None:
            pass

        async def received(self, frames: list[bytes]) -> None:
            heard.append(frames)

    ports = [free_port() for _ in range(400)]
    transport = ZmqEventTransport()
    publisher = KvEventPublisher(f"tcp://*:{ports[-1]}")
    tasks = [asyncio.get_running_loop().create_task(transport.subscribe(f"tcp://127.0.0.1:{port}", Receiver()))
             for port in ports]
    try:
        deadline = time.monotonic() + 20
        while not heard:
            assert time.monotonic() < deadline, "the last subscription never heard its publisher"
            assert not any(task.done() for task in tasks), [t.exception() for t in tasks if t.done()][:1]
            publisher.publish([AllBlocksCleared()])
            await asyncio.sleep(0.1)
        assert not any(task.done() for task in tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        transport.close()
        await publisher.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_workers_file_that_never_answers_does_not_hang_discovery(tmp_path: Path) -> None:
    """A `file:` discovery source whose read never returns (a FIFO nobody writes, a hung network mount): the
    gateway awaited it without a timeout, so it never started (the first discovery round is awaited at start) and
    discovery stopped for every source. Now such a read fails the round for its source after the discovery
    timeout, the other sources go on, and a read still pending is not started again."""
    stuck = tmp_path / "stuck.yaml"
    os.mkfifo(stuck)
    listed = tmp_path / "workers.yaml"
    try:
        async with running_standin() as worker:
            listed.write_text(f"- {worker.url}\n")
            async with asyncio.timeout(15), running_gateway(
                    [], discover=[f"file:{stuck}", f"file:{listed}"], discover_interval_s=0.5) as gw:
                assert [w.url for w in gw.gateway.pool.all()] == [worker.url]
                metrics = gw.gateway.metrics
                await eventually(lambda: (metrics.registry.get_sample_value(
                    "kvgate_discovery_errors_total", {"source": f"file:{stuck}"}) or 0) >= 2)
                assert threading.active_count() < 30  # one read left waiting, not one per round
    finally:
        with contextlib.suppress(OSError):  # a writer that comes and goes lets the read end
            os.close(os.open(stuck, os.O_WRONLY | os.O_NONBLOCK))

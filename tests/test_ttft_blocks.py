"""The `ttft` strategy's wait for KV blocks: an engine admits a request only once its whole prompt fits in the
blocks that are free, and the gateway's requests there hold theirs until they end. The wait on its own
(`block_wait`, exact numbers), the ledger of what the gateway's requests hold, the output lengths it learns, the
choice it changes, the engine's cache size read from vLLM's `/metrics` (`vllm:cache_config_info`, a real `kvgate
sim` replica's), and a virtual fleet that waits for blocks."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench import vsim
from bench.traces import ConversationShape, Trace, TraceSource, conversation_trace, write_trace
from bench.workloads import PromptVocabulary
from kvcore.kv_events import GPU
from router.block_keys import block_keys
from router.pool import Worker, parse_cache_config
from router.requests import CHAT_COMPLETIONS, COMPLETIONS, read_payload
from router.routing import Decision, RouteRequest
from strategies.balance import HIT
from strategies.ttft import BlockLedger, OutputLength, TtftAware, _Holder, block_wait
from tests.abuse_servers import raw_worker
from tests.conftest import eventually, running_gateway
from tests.test_ttft_strategy import BS, OPTIONS, ROOT, make, request, tokens

PREDICTED_ERROR = 0.3
# a decode step of 10 ms before the streams show one (the step phase off: nothing learns it)
BLOCKED = dataclasses.replace(OPTIONS, ttft_decode_step_s=0.01, ttft_step_phase=False)


def test_a_request_waits_until_enough_blocks_are_free() -> None:
    assert block_wait(300.0, [(2.0, 150.0, 0.0)], [], 180.0) == 0.0  # fits now
    # 100 free; two requests end in 1 s (50 blocks) and 2 s (150): 180 fit once both have ended
    assert block_wait(100.0, [(2.0, 150.0, 0.0), (1.0, 50.0, 0.0)], [], 180.0) == 2.0
    assert block_wait(100.0, [(2.0, 150.0, 0.0), (1.0, 50.0, 0.0)], [], 150.0) == 1.0


def test_decoding_requests_take_blocks_as_they_go() -> None:
    """20 free; one request holding 60 blocks ends in 1 s, another holds 20 and runs 3 s; each takes 10 blocks a
    second. At 1 s the first frees 70 (what it grew to), the second has taken 10 more: 70 are free, not 80."""
    running = [(1.0, 60.0, 10.0), (3.0, 20.0, 10.0)]
    assert block_wait(20.0, running, [], 70.0) == 1.0
    assert block_wait(20.0, running, [], 71.0) == 3.0


def test_the_engines_queue_is_admitted_in_order_and_its_head_holds_back_the_rest() -> None:
    # 10 blocks would fit now, but a request for 150 is ahead of it: both wait for the 100 freed at 1 s
    assert block_wait(100.0, [(1.0, 100.0, 0.0)], [(150.0, 3.0, 0.0)], 10.0) == 1.0
    # the one ahead, admitted at 1 s, runs 3 s: 60 more blocks come only when it ends, at 4 s
    assert block_wait(100.0, [(1.0, 100.0, 0.0)], [(150.0, 3.0, 0.0)], 60.0) == 4.0


def test_a_prompt_that_never_fits_waits_for_everything_listed_to_end() -> None:
    assert block_wait(10.0, [(1.0, 5.0, 0.0), (0.5, 5.0, 0.0)], [], 100.0) == 1.0
    assert block_wait(10.0, [], [], 100.0) == 0.0


def test_the_ledger_holds_prompt_and_generated_blocks_until_the_end() -> None:
    ledger = BlockLedger(16)
    ledger.add(1, _Holder(prompt=320, max_tokens=100, output=100.0, prefill_s=0.05, routed_at=0.0, expected_s=0.06,
                          stream=True))
    assert ledger.held == 20
    ledger.first_token(1)
    for _ in range(40):  # tokens 321-360: blocks begin at the 321st, 337th and 353rd
        ledger.chunk(1)
    assert ledger.held == 23
    together = BlockLedger(16)  # the same tokens read together: the same blocks
    together.add(1, _Holder(prompt=320, max_tokens=100, output=100.0, prefill_s=0.05, routed_at=0.0,
                            expected_s=0.06, stream=True))
    for n in (1, 15, 0, 17, 7):
        together.chunk(1, n)
    assert together.held == 23
    # 30 blocks for the gateway's requests, 7 free: a 20-block prompt waits for the 60 tokens left at 10 ms a step
    assert abs(ledger.wait(1.0, 30.0, 20, 0.01) - 0.6) < 1e-12
    assert ledger.wait(1.0, 43.0, 20, 0.01) == 0.0
    # one sent after it and not admitted yet: it is ahead of the next request in the engine's queue, and runs its
    # prefill and 50 tokens once admitted
    ledger.add(2, _Holder(prompt=160, max_tokens=50, output=50.0, prefill_s=0.02, routed_at=1.0, expected_s=0.03,
                          stream=True))
    assert ledger.held == 33
    # admitted when the first ends (0.6 s), it leaves 20 blocks: enough for 20, 21 wait for it to end too
    assert abs(ledger.wait(1.0, 30.0, 20, 0.01) - 0.6) < 1e-12
    assert abs(ledger.wait(1.0, 30.0, 21, 0.01) - (0.6 + 0.02 + 0.5)) < 1e-12
    # a whole answer counts as admitted once its predicted first token has passed, decoding since
    ledger.add(3, _Holder(prompt=16, max_tokens=10, output=10.0, prefill_s=0.0, routed_at=0.0, expected_s=0.9,
                          stream=False))
    assert abs(ledger.wait(1.0, 31.0, 20, 0.01) - 0.6) < 1e-12  # 10 tokens since: it ends within a step
    ended = ledger.end(1, 2.0)
    assert ended is not None and ended.generated == 40 and ledger.held == 11
    assert ledger.ended_since(1.5) == 23 and ledger.ended_since(2.5) == 0
    assert ledger.end(1, 2.0) is None


def test_output_lengths_are_learned_as_a_share_of_max_tokens_or_a_mean() -> None:
    output = OutputLength(340.0, half_life=1.0)  # an old answer counts half after one more
    assert output.expected(100) == 100.0 and output.expected(None) == 340.0
    output.learn(100, 50)  # the prior (all of max_tokens) and this answer, 1 : 2 (weights 0.5 + 1 -> 1.5)
    assert abs(output.share - (1.0 + (0.5 - 1.0) / 1.5)) < 1e-12
    output.learn(None, 40)
    assert abs(output.tokens - (340.0 + (40.0 - 340.0) / 1.5)) < 1e-12
    output.learn(10, 30)  # more than max_tokens is a share of 1
    assert abs(output.share - (2 / 3 + (1.0 - 2 / 3) / 1.75)) < 1e-12


def setup_blocked(options: Any) -> tuple[TtftAware, list[Worker], list[float], list[int],
                                         tuple[RouteRequest, Decision]]:
    """Two workers with 40 usable blocks each (641 tokens). Worker 0 holds a 320-token prefix and decodes a
    480-token request that has generated 50 of its 200 tokens (34 blocks)."""
    strategy, workers, index, clock = make(2, options)
    for worker in workers:
        worker.kv_blocks, worker.kv_block_size = 41, BS  # vLLM's count has the null block
    prefix = tokens(1, 320)
    index.add(workers[0].url, block_keys(prefix, BS, ROOT), GPU)
    big = request(tokens(3, 480))
    big.stream, big.max_tokens = True, 200
    decision = strategy.choose(big, workers[:1])
    workers[0].in_flight = 1
    assert decision.predicted_ttft_s is not None
    strategy.on_first_token(big, decision, decision.predicted_ttft_s)  # as predicted: the fit stays as it was
    for _ in range(50):
        strategy.on_chunk(big, decision, False)
    return strategy, workers, clock, prefix, (big, decision)


def test_the_wait_for_blocks_is_predicted_and_left_out_of_the_choice() -> None:
    """Worker 0 holds the prompt's first 320 tokens, but its cache has 6 blocks free and the request needs 24 (its
    whole prompt: the cached blocks no running request uses count as well, as vLLM counts them); they free when
    the request decoding there ends, in 150 steps of 10 ms (it takes no block more in them: 34 blocks hold its 680
    tokens at the end, 531 now). The prediction for worker 0 carries that wait; the choice does not weigh it (a
    wait for the fleet's blocks moves between requests, docs/ttft.md), so the request still goes to its prefix."""
    strategy, workers, clock, prefix, _ = setup_blocked(BLOCKED)
    prompt = request(prefix + tokens(2, 64))
    held = strategy.holdings(prompt.block_keys, workers, 384)
    e = strategy.estimate(workers[0], 384, held[0], clock[0])
    assert abs(e.blocks_s - 1.5) < 1e-12 and abs(e.ttft_s - (0.01 + 0.0064 + 1.5)) < 1e-12
    assert abs(e.choice_s - (0.01 + 0.0064)) < 1e-12
    assert strategy.estimate(workers[1], 384, held[1], clock[0]).blocks_s == 0.0  # nothing held there
    decision = strategy.choose(prompt, workers)
    assert decision.worker is workers[0] and decision.reason == HIT
    assert decision.predicted_ttft_s is not None and abs(decision.predicted_ttft_s - 1.5164) < 1e-12

    blind, workers, _, prefix, _ = setup_blocked(dataclasses.replace(BLOCKED, ttft_block_wait=False))
    decision = blind.choose(request(prefix + tokens(2, 64)), workers)
    assert decision.worker is workers[0] and decision.predicted_ttft_s is not None
    assert abs(decision.predicted_ttft_s - 0.0164) < 1e-12


def test_blocks_in_use_beyond_the_gateways_own_are_someone_elses() -> None:
    """Another gateway's requests hold blocks the ledger does not know of: as much of the engine's scraped usage
    as the gateway's own requests do not explain, counting those that ended within two scrape intervals (the
    usage may be that old)."""
    strategy, workers, clock, _, (big, decision) = setup_blocked(BLOCKED)
    worker = workers[0]
    ledger = strategy.ledgers[worker.url]
    assert ledger.held == 34
    worker.kv_usage = 0.5  # 20 of 40 in use: fewer than the gateway's own hold (the scrape is older)
    assert strategy.blocks_for_us(worker, ledger, clock[0]) == 40.0
    worker.kv_usage = 1.0
    assert strategy.blocks_for_us(worker, ledger, clock[0]) == 34.0
    strategy.request_ended(big, decision)
    assert ledger.held == 0 and strategy.blocks_for_us(worker, ledger, clock[0]) == 34.0
    assert abs(strategy.output.share - (1.0 + (0.25 - 1.0) / (0.5 ** (1 / 200) + 1.0))) < 1e-12  # 50 of 200
    clock[0] += 2.5  # the scrape that saw them is more than two intervals old
    assert strategy.blocks_for_us(worker, ledger, clock[0]) == 0.0


def test_a_cache_of_unknown_size_is_judged_by_its_usage() -> None:
    strategy, workers, clock, _, _ = setup_blocked(dataclasses.replace(BLOCKED, ttft_kv_full_penalty_s=0.5))
    for worker in workers:
        worker.kv_usage = 0.95
    held = strategy.holdings([], workers, 0)
    assert strategy.estimate(workers[1], 16, held[1], clock[0]).pressure_s == 0.0  # its size known: no penalty
    workers[1].kv_blocks = 0
    assert abs(strategy.estimate(workers[1], 16, held[1], clock[0]).pressure_s - 0.25) < 1e-12


def test_the_cache_size_is_read_from_vllms_cache_config_info() -> None:
    text = ('# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
            '# TYPE vllm:cache_config_info gauge\n'
            'vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",'
            'cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",'
            'is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="27186",'
            'num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",'
            'swap_space="4",swap_space_bytes="4294967296"} 1.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n')
    assert parse_cache_config(text) == (27186, 16)
    assert parse_cache_config(text.replace('num_gpu_blocks="27186"', 'num_gpu_blocks="None"')) is None
    assert parse_cache_config("vllm:kv_cache_usage_perc 0.25\n") is None


async def test_the_gateway_reads_a_simulated_engines_cache_size(sim_fleet: Any, http: aiohttp.ClientSession) -> None:
    fleet = sim_fleet(1, extra_args=["--num-gpu-blocks-override", "1234"])
    async with running_gateway(fleet.worker_specs, strategy="ttft") as gw:
        worker = gw.gateway.pool.get(fleet.urls[0])
        assert worker is not None
        await eventually(lambda: worker.kv_blocks == 1234 and worker.kv_block_size == 16)


def test_a_virtual_fleet_whose_requests_wait_for_blocks_is_predicted(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The pinned replays' fleet (tests/test_vsim_results.py: a small conversation trace on four replicas whose
    400-block caches hold about one of its prompts at a time): requests wait seconds for blocks while little is
    queued. That wait is what the prediction lacked; with it the median error of the predicted TTFT falls from
    over half to PREDICTED_ERROR."""
    path = tmp_path / "conv.jsonl"
    write_trace(path, conversation_trace(ConversationShape(requests=300, duration_s=60.0, seed=3)))
    vocab = PromptVocabulary.from_model_dir(tiny_model_dir)
    rows = {}
    for wait in (False, True):
        source = TraceSource(Trace(path, report=None), vocab, block_tokens=32)
        sim = vsim.FleetSimulation(source, strategy="ttft", replicas=4, gpu_blocks=400,
                                   config_overrides={"ttft_block_wait": wait})
        rows[wait] = sim.run()
    before = rows[False]["ttft_prediction"]["median_abs_relative_error"]
    after = rows[True]["ttft_prediction"]["median_abs_relative_error"]
    print(before, after, rows[False]["ttft_ms_p50"], rows[True]["ttft_ms_p50"], rows[False]["hit_rate"],
          rows[True]["hit_rate"])
    assert before > 0.5 and after < PREDICTED_ERROR, (before, after)


def test_the_gateway_reads_how_many_tokens_a_request_may_generate() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 64}
    assert read_payload(COMPLETIONS, body, model_required=True).max_tokens == 64
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
            "max_completion_tokens": 32}
    assert read_payload(CHAT_COMPLETIONS, chat, model_required=True).max_tokens == 32  # vLLM's precedence
    assert read_payload(COMPLETIONS, {"model": "m", "prompt": "hi"}, model_required=True).max_tokens is None


async def test_a_streamed_answer_holds_its_blocks_in_the_ledger_until_it_ends(sim_fleet: Any,
                                                                              http: aiohttp.ClientSession) -> None:
    """Through the gateway, against a `kvgate sim` replica: a streamed request's max_tokens reaches the strategy,
    each relayed chunk is a token more in its blocks, and its end frees them and teaches the output length."""
    fleet = sim_fleet(1, extra_args=["--num-gpu-blocks-override", "256"])
    url = fleet.urls[0]
    async with running_gateway(fleet.worker_specs, strategy="ttft") as gw:
        worker = gw.gateway.pool.get(url)
        assert worker is not None
        await eventually(lambda: worker.healthy and worker.kv_blocks == 256)
        strategy: Any = gw.gateway.strategy
        body = {"model": "tiny", "prompt": list(range(1, 101)), "max_tokens": 60, "stream": True,
                "ignore_eos": True}
        seen: list[int] = []
        async with http.post(gw.url + "/v1/completions", data=orjson.dumps(body),
                             headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 200
            async for _ in resp.content:
                ledger = strategy.ledgers.get(url)
                if ledger is not None and len(ledger):
                    seen.append(ledger.held)
        # 100 prompt tokens: 7 blocks; from the 45th token on, 10 (fewer if a loaded gateway reads tokens together)
        assert min(seen) == 7 and 8 <= max(seen) <= 10, seen
        await eventually(lambda: len(strategy.ledgers[url]) == 0)
        assert strategy.ledgers[url].held == 0
        # all of max_tokens, as the prior said (counted by events, however the gateway read them)
        assert strategy.output.learned == 1 and strategy.output.share == 1.0


async def test_tokens_read_together_count_each_in_the_ledger(http: aiohttp.ClientSession) -> None:
    """A regression: the ledger counted a relayed chunk as one token, so a loaded gateway that read several events
    in one chunk learned a short output (share 0.908 of max_tokens seen under load): 60 tokens in 6 chunks of 10
    then counted 7 (the `[DONE]` chunk too). Events are counted now, a `data:` inside a text and `[DONE]` not."""
    metrics = (b'vllm:cache_config_info{block_size="16",num_gpu_blocks="256"} 1.0\n'
               b'vllm:kv_cache_usage_perc{engine="0"} 0.0\n')
    text = [b'data: {"choices":[{"index":0,"text":"data: %d"}]}\n\n' % i for i in range(60)]
    groups = [b"".join(text[i:i + 10]) for i in range(0, 60, 10)]

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for part in [*groups[:3], groups[3][:25], groups[3][25:], *groups[4:], b"data: [DONE]\n\n"]:
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
            await asyncio.sleep(0.02)  # each its own read
        writer.write(b"0\r\n\r\n")

    async with raw_worker(answer, metrics=metrics) as url, running_gateway([url], strategy="ttft") as gw:
        worker = gw.gateway.pool.get(url)
        assert worker is not None
        await eventually(lambda: worker.healthy and worker.kv_blocks == 256)
        strategy: Any = gw.gateway.strategy
        body = {"model": "tiny", "prompt": list(range(1, 101)), "max_tokens": 60, "stream": True}
        async with http.post(gw.url + "/v1/completions", data=orjson.dumps(body),
                             headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 200
            assert (await resp.read()).count(b"data: {") == 60
        await eventually(lambda: strategy.output.learned == 1)
        assert strategy.output.share == 1.0
        assert strategy.ledgers[url].held == 0 and len(strategy.ledgers[url]) == 0

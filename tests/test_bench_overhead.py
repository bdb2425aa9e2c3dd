"""`kvgate bench overhead` end to end on a small scale: stand-ins, one kvgate target, both APIs, the /health stall
probe, the JSON report."""

from __future__ import annotations

import argparse
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.overhead import ScenarioResult, Workload, add_arguments, run, summary
from tests.conftest import recorded_speed


@contextlib.asynccontextmanager
async def _serving(routes: list[Any]) -> AsyncIterator[int]:
    """An aiohttp app with these routes on a free loopback port, for the test's duration; yields the port."""
    from aiohttp import web

    app = web.Application()
    app.router.add_routes(routes)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


def test_workload_shares_system_prompts_and_never_repeats_a_question() -> None:
    w = Workload("chat", 500, 4, False)
    bodies = [orjson.loads(b) for b in w.bodies(8)]
    systems = [b["messages"][0]["content"] for b in bodies]
    assert len(set(systems)) == 4 and systems[:4] == systems[4:] and all(len(s) == 500 for s in systems)
    assert len({b["messages"][1]["content"] for b in bodies}) == 8
    completion = orjson.loads(Workload("completions", 500, 4, False).bodies(1)[0])
    assert completion["prompt"].startswith(systems[0])


def test_overhead_benchmark_runs_and_reports(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "overhead.json"
    args = parser.parse_args(["--target", "kvgate:prefix", "--prompt-chars", "300", "--system-prompts", "4",
                              "--requests", "40", "--rounds", "1", "--concurrency", "1", "--concurrency", "4",
                              "--workers", "2", "--stall-chars", "2000", "--stall-requests", "5", "--out", str(out)])
    assert run(args) == 0
    report = orjson.loads(out.read_bytes())
    assert {(r["api"], r["concurrency"]) for r in report["results"]} == {
        ("chat", 1), ("chat", 4), ("completions", 1), ("completions", 4)}
    assert all(r["target"] == "kvgate:prefix" and r["errors"] == 0 and r["gateway_rps"] > 0
               for r in report["results"])
    assert [s["api"] for s in report["health_stalls"]] == ["chat", "completions"]
    assert all(s["health_probes"] > 0 and s["errors"] == 0 for s in report["health_stalls"])
    assert recorded_speed(report["machine_speed"])


def test_stream_mode_relays_every_token_as_an_event_and_reports_cpu_per_event(tmp_path: Path) -> None:
    """`--stream-tokens 16`: the requests ask max_tokens 16, the stand-ins answer with 16 token events and
    `data: [DONE]`, the client counts all 17 through the router, and the router's CPU is divided by them."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "overhead.json"
    args = parser.parse_args(["--target", "kvgate:round_robin", "--mode", "stream", "--stream-tokens", "16",
                              "--token-interval-ms", "1", "--prompt-chars", "300", "--system-prompts", "4",
                              "--requests", "64", "--rounds", "1", "--concurrency", "8", "--workers", "2",
                              "--out", str(out)])
    assert run(args) == 0
    report = orjson.loads(out.read_bytes())
    assert report["max_tokens"] == 16 and report["token_interval_ms"] == 1
    assert {r["api"] for r in report["results"]} == {"chat", "completions"}
    for row in report["results"]:
        assert row["mode"] == "stream" and row["errors"] == 0 and row["requests"] == 64
        assert row["events_per_request"] == 17  # 16 tokens and [DONE], every answer
        assert row["gateway_cpu_us_per_event"] > 0
        # the same CPU, divided by the requests or by their events
        assert row["gateway_cpu_us_per_event"] == pytest.approx(row["gateway_cpu_us_per_request"] / 17)


def test_json_results_have_no_event_figures_and_the_summary_keeps_modes_apart() -> None:
    """A run of both modes: the summary has a table per mode (one table of both kept whichever came last), the
    stream's with its events and CPU per event."""
    def row(mode: str, cpu: float, events: float | None) -> ScenarioResult:
        return ScenarioResult("kvgate:round_robin", "chat", 300, mode, 8, 64, 1, 2, 1.5, 2.5, 0.5, 0.5, 900, 800,
                              cpu, 0, events, cpu / events if events else None)

    lines = list(summary([row("json", 111, None), row("stream", 340, 17)]))
    json_at = lines.index("\nchat, 300-character system prompts + 200-character question")
    stream_at = lines.index("\nchat, 300-character system prompts + 200-character question, streamed answers")
    assert "events/req" not in lines[json_at + 1] and lines[json_at + 2].split()[:2] == ["kvgate:round_robin", "111"]
    assert "CPU µs/event (c8)" in lines[stream_at + 1]
    assert lines[stream_at + 2].split()[1] == "340" and lines[stream_at + 2].split()[-2:] == ["17.0", "20.0"]


def test_wrk_client_refuses_paced_streams(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """nginx answers with one canned body: it cannot send a token per event or pace them."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for extra in (["--stream-tokens", "8"], ["--token-interval-ms", "2"]):
        args = parser.parse_args(["--client", "wrk", "--mode", "stream", *extra, "--out", str(tmp_path / "o.json")])
        assert run(args) == 2
        assert "--client wrk: no --stream-tokens over 1 or --token-interval-ms" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def test_the_client_counts_events_split_across_reads() -> None:
    """An SSE body written in pieces that split `data:` and its line: every event counted once."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from bench.overhead import _drive

    pieces = [b"data: {\"a\": 1}\n", b"\nda", b"ta: {\"data: no\": 2}\n\n", b"data: [DO", b"NE]\n\n"]

    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
            await asyncio.sleep(0.02)  # each piece its own read at the client
        await response.write_eof()
        return response

    async def main() -> int:
        async with _serving([web.post("/v1/completions", answer)]) as port, aiohttp.ClientSession() as session:
            sample = await _drive(session, [f"http://127.0.0.1:{port}/v1/completions"], [b"{}", b"{}"], True, 1)
        assert sample.errors == 0
        return sample.events

    assert asyncio.run(main()) == 6  # three events per answer, two answers


def test_the_readme_overhead_commands_parse() -> None:
    """Every `kvgate bench overhead ...` command the README shows is accepted by its parser."""
    import re
    import shlex

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text().replace("\\\n", " ")
    commands = re.findall(r"`kvgate bench overhead ([^`]*)`", readme)
    commands += re.findall(r"^kvgate bench overhead (.*)$", readme, re.M)
    assert any("--stream-tokens" in c for c in commands)
    for rest in commands:
        parser = argparse.ArgumentParser(exit_on_error=False)
        add_arguments(parser)
        parser.parse_args(shlex.split(rest))


@pytest.mark.skipif(shutil.which("git") is None or not (Path(__file__).resolve().parent.parent / ".git").exists(),
                    reason="needs this repository's git history")
def test_against_runs_a_revision_side_by_side(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "overhead.json"
    args = parser.parse_args(["--target", "kvgate:round_robin", "--against", "HEAD", "--api", "completions",
                              "--prompt-chars", "300", "--system-prompts", "4", "--requests", "100", "--rounds", "2",
                              "--concurrency", "2", "--workers", "2", "--out", str(out)])
    assert run(args) == 0
    report = orjson.loads(out.read_bytes())
    assert sorted(r["target"] for r in report["results"]) == ["kvgate:round_robin", "kvgate:round_robin@HEAD"]
    assert all(r["errors"] == 0 and r["gateway_cpu_us_per_request"] > 0 for r in report["results"])


def test_wrk_client_runs_every_target_and_process_count_side_by_side(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "overhead.json"
    args = parser.parse_args(["--client", "wrk", "--target", "kvgate:prefix", "--target", "kvgate:round_robin:p2",
                              "--prompt-chars", "300", "--system-prompts", "4", "--seconds", "1", "--rounds", "1",
                              "--concurrency", "1", "--concurrency", "4", "--workers", "2", "--out", str(out)])
    assert run(args) == 0, "needs wrk and nginx (scripts/system-deps.sh)"
    report = orjson.loads(out.read_bytes())
    assert report["client"] == "wrk" and report["seconds_per_round"] == 1
    rows = {(r["target"], r["api"], r["concurrency"]): r for r in report["results"]}
    assert set(rows) == {(t, api, c) for t in ("kvgate:prefix", "kvgate:round_robin:p2")
                         for api in ("chat", "completions") for c in (1, 4)}
    for row in rows.values():  # wrk counts any answer but 2xx/3xx as an error
        assert row["errors"] == 0 and row["requests"] > 0 and row["gateway_cpu_us_per_request"] > 0
        assert 0 < row["direct_p50_ms"] <= row["direct_p99_ms"] and 0 < row["gateway_p50_ms"] <= row["gateway_p99_ms"]


def test_nginx_standins_answer_like_vllm_and_wrk_sends_unique_questions(tmp_path: Path) -> None:
    """The C stand-ins' canned answers parse as vLLM's; wrk's script sends the workload's bodies, each question
    made unique, to a recording server."""
    import asyncio
    import urllib.request

    from aiohttp import web

    from bench.wrk_load import nginx_standins, run_wrk, write_script

    with nginx_standins(2, tmp_path / "nginx") as urls:
        assert len(urls) == 2
        models = orjson.loads(urllib.request.urlopen(urls[1] + "/v1/models", timeout=5).read())
        assert models["data"][0]["id"] == "tiny"
        for path, obj in (("/v1/chat/completions", "chat.completion"), ("/v1/completions", "text_completion")):
            request = urllib.request.Request(urls[0] + path, data=b'{"model": "tiny"}',
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=5) as resp:
                answer = orjson.loads(resp.read())
            assert resp.headers["Content-Type"] == "application/json"
            assert answer["object"] == obj and answer["usage"]["completion_tokens"] == 8
        assert b"vllm:num_requests_running" in urllib.request.urlopen(urls[0] + "/metrics", timeout=5).read()
    with nginx_standins(1, tmp_path / "nginx-stream", stream=True) as urls:  # `--mode stream`: one SSE answer
        for path, field in (("/v1/chat/completions", "delta"), ("/v1/completions", "text")):
            request = urllib.request.Request(urls[0] + path, data=b'{"model": "tiny", "stream": true}',
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=5) as resp:
                events = resp.read().split(b"\n\n")
            assert resp.headers["Content-Type"] == "text/event-stream"
            assert events[1:] == [b"data: [DONE]", b""] and field in orjson.loads(events[0][6:])["choices"][0]

    workload = Workload("chat", 300, 4, False)
    bodies = workload.bodies(8)
    (tmp_path / "bodies").write_bytes(b"\n".join(bodies) + b"\n")
    seen: list[dict[str, Any]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({})

    async def main() -> None:
        app = web.Application()
        app.router.add_post(workload.path, record)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            run = await asyncio.to_thread(run_wrk, f"http://127.0.0.1:{port}", workload.path, tmp_path / "bodies",
                                          write_script(tmp_path), 2, 1, "r7")
        finally:
            await runner.cleanup()
        # wrk stops at its deadline: the requests in flight then (one per connection) reached the server uncounted
        assert run.errors == 0 and 8 < run.requests <= len(seen) <= run.requests + 2

    asyncio.run(main())
    sent = [orjson.loads(b) for b in bodies]
    questions = [body["messages"][1]["content"] for body in seen]
    assert len(set(questions)) == len(questions)  # every one unique, across wrk's two threads
    for body, question in zip(seen, questions, strict=True):
        number, _, rest = question.partition(": ")
        assert number.startswith("Question r7t") and number[len("Question r7t"):].partition("x")[0] in ("1", "2")
        # the rest of the body is one of the workload's, question number aside
        assert any(s["messages"][0] == body["messages"][0] and s["messages"][1]["content"].partition(": ")[2] == rest
                   for s in sent)


def test_health_prober_times_each_probe_and_counts_failed_answers() -> None:
    """bench/health_probe.py in its own process against a real server: every probe timed, answers other than 200
    counted, and it stops and reports when its stdin closes."""
    import asyncio
    import subprocess
    import sys

    from aiohttp import web

    answers = iter([200, 200, 503])
    root = Path(__file__).resolve().parent.parent

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=next(answers, 200), text="ok")

    async def main() -> dict[str, Any]:
        async with _serving([web.get("/health", health)]) as port:
            prober = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench.health_probe", f"http://127.0.0.1:{port}", "0.005",
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=root)
            assert prober.stdout is not None
            assert (await asyncio.wait_for(prober.stdout.readline(), 30)).strip() == b"ready"
            await asyncio.sleep(0.3)
            out, _ = await asyncio.wait_for(prober.communicate(b""), 30)  # b"": stdin closed (None leaves it open)
        assert prober.returncode == 0
        return orjson.loads(out)  # type: ignore[no-any-return]

    report = asyncio.run(main())
    assert len(report["waits"]) >= 10 and all(0 < w < 5 for w in report["waits"])
    assert report["errors"] == 1

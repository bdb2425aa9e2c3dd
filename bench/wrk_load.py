"""A load generator and stand-in workers written in C, for `kvgate bench overhead --client wrk`: wrk sends the
requests, one nginx process answers them as the stand-in workers with vLLM's canned answers.

Why: the Python client and stand-ins (`--client python`, the default) cost about as much CPU per request as the
router they measure, and on a machine with few cores they take the cores the router would use: a router's CPU per
request reads higher (caches shared, the run queue longer) and a second gateway process has no core to run on. wrk
(an epoll loop, the request built by a few lines of Lua) and nginx answering with a fixed body cost about a tenth of
that, so what is measured is the router.

Each request is one of the workload's bodies with its question made unique (`Question <run>t<thread>x<n>:`): the
bodies are written to a file once, and the Lua script splits each at its question's number, so a request costs one
string concatenation, not a JSON encode.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import orjson

from bench.procs import free_port, stop, wait_http

_CHAT = {"id": "cmpl-standin", "object": "chat.completion", "created": 0, "model": "tiny",
         "choices": [{"index": 0, "message": {"role": "assistant", "content": " t0 t1 t2 t3 t4 t5 t6 t7"},
                      "finish_reason": "length"}],
         "usage": {"prompt_tokens": 1, "completion_tokens": 8, "total_tokens": 9}}
_COMPLETION = {"id": "cmpl-standin", "object": "text_completion", "created": 0, "model": "tiny",
               "choices": [{"index": 0, "text": " t0 t1 t2 t3 t4 t5 t6 t7", "finish_reason": "length"}],
               "usage": {"prompt_tokens": 1, "completion_tokens": 8, "total_tokens": 9}}
_MODELS = {"object": "list", "data": [{"id": "tiny", "object": "model", "created": 0, "owned_by": "vllm",
                                       "root": "tiny", "max_model_len": 131072}]}
_METRICS = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="tiny"} 0\n'
            '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="tiny"} 0.0\n')

# wrk's script: `init` reads the bodies and splits each at its question's number; `done` prints what was measured
# on one line (latencies in microseconds). `tid` is a global, not a local: `thread:set` sets the thread's globals
LUA = r"""
local heads, tails, n, counter, threads = {}, {}, 0, 0, 0
local path, run = os.getenv("KVGATE_WRK_PATH"), os.getenv("KVGATE_WRK_RUN")
function setup(thread)  -- in the main Lua state; each thread gets its number as its own global `tid`
  threads = threads + 1
  thread:set("tid", threads)
end
function init(args)
  for line in io.lines(os.getenv("KVGATE_WRK_BODIES")) do
    local a, b = string.find(line, "Question %d+")
    if a then
      n = n + 1
      heads[n] = string.sub(line, 1, a + 8)
      tails[n] = string.sub(line, b + 1)
    end
  end
  if n == 0 then error("no bodies with a question in " .. os.getenv("KVGATE_WRK_BODIES")) end
end
function request()
  counter = counter + 1
  local i = counter % n + 1
  return wrk.format("POST", path, {["Content-Type"] = "application/json"},
                    heads[i] .. run .. "t" .. tid .. "x" .. counter .. tails[i])
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("KVGATE_WRK %d %d %d %d %d %d %d %d %d\n", summary.requests, summary.duration,
                         e.connect, e.read, e.write, e.status, e.timeout,
                         latency:percentile(50), latency:percentile(99)))
end
"""


def _program(name: str) -> str | None:
    """A program on PATH, or in /usr/sbin (Debian's nginx, off a non-root user's PATH)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin")


def missing_tools() -> list[str]:
    """The programs `--client wrk` needs that are not installed (scripts/system-deps.sh installs them)."""
    return [tool for tool in ("wrk", "nginx") if _program(tool) is None]


@dataclass
class WrkRun:
    requests: int
    wall_s: float
    errors: int  # connect, read, write and timeout errors, and answers other than 2xx/3xx
    p50_s: float
    p99_s: float


def _canned(api: str, stream: bool) -> tuple[str, bytes]:
    """The content type and body a stand-in answers a generation request with."""
    answer = _CHAT if api == "chat" else _COMPLETION
    if not stream:
        return "application/json", orjson.dumps(answer)
    if api == "chat":  # a stream's chat chunk carries a delta, not a message (vLLM's ChatCompletionStreamResponse)
        choice = {"index": 0, "delta": {"role": "assistant", "content": " t0 t1 t2 t3 t4 t5 t6 t7"},
                  "finish_reason": "length"}
        chunk = dict(answer, object="chat.completion.chunk", choices=[choice])
    else:
        chunk = answer
    return "text/event-stream", b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n"


def _nginx_string(data: bytes) -> str:
    """`data` as an nginx double-quoted string."""
    return '"' + data.decode().replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def nginx_config(ports: list[int], workdir: Path, stream: bool) -> str:
    """One nginx process serving a stand-in worker on each port: canned generation answers, `/v1/models`,
    `/health` and vLLM's load gauges on `/metrics`."""
    locations = []
    for api, path in (("chat", "/v1/chat/completions"), ("completions", "/v1/completions")):
        content_type, body = _canned(api, stream)
        locations.append(f"location = {path} {{ default_type {content_type}; return 200 {_nginx_string(body)}; }}")
    locations += [f"location = /v1/models {{ return 200 {_nginx_string(orjson.dumps(_MODELS))}; }}",
                  "location = /health { return 200 ''; }",
                  f"location = /metrics {{ default_type text/plain; return 200 {_nginx_string(_METRICS.encode())}; }}"]
    servers = "\n".join(
        f"  server {{ listen 127.0.0.1:{port}; default_type application/json; {' '.join(locations)} }}"
        for port in ports)
    return (f"daemon off; worker_processes 1; pid {workdir}/nginx.pid; error_log {workdir}/nginx-error.log;\n"
            "events { worker_connections 4096; }\n"
            f"http {{ access_log off; keepalive_requests 1000000; client_body_buffer_size 64k;\n"
            f"  client_body_temp_path {workdir}/body; client_max_body_size 64m;\n{servers}\n}}\n")


@contextmanager
def nginx_standins(count: int, workdir: Path, stream: bool = False) -> Iterator[list[str]]:
    """`count` stand-in workers in one nginx process; yields their URLs."""
    ports = [free_port() for _ in range(count)]
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "nginx.conf"
    config.write_text(nginx_config(ports, workdir, stream))
    with open(workdir / "nginx-stderr.log", "wb") as stderr:
        proc = subprocess.Popen([_program("nginx") or "nginx", "-c", str(config), "-p", str(workdir)],
                                stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for url in urls:
            wait_http(url + "/health", timeout=15, proc=proc,
                      log_tail=lambda: (workdir / "nginx-stderr.log").read_text(errors="replace")[-800:])
        yield urls
    finally:
        stop(proc)


def write_script(workdir: Path) -> Path:
    script = workdir / "kvgate-wrk.lua"
    script.write_text(LUA)
    return script


def run_wrk(url: str, path: str, bodies: Path, script: Path, concurrency: int, seconds: float,
            run_id: str) -> WrkRun:
    """`concurrency` connections sending the bodies in `bodies` (one JSON per line) to `url + path` for `seconds`,
    each request's question made unique with `run_id`."""
    env = dict(os.environ, KVGATE_WRK_PATH=path, KVGATE_WRK_RUN=run_id, KVGATE_WRK_BODIES=str(bodies))
    argv = ["wrk", f"-t{min(2, concurrency)}", f"-c{concurrency}", f"-d{max(1, round(seconds))}s", "--timeout", "10s",
            "-s", str(script), url]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=seconds + 60)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("KVGATE_WRK ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stdout[-600:]} {done.stderr[-600:]}")
    requests, duration_us, *errors, p50_us, p99_us = (int(x) for x in line.split()[1:])
    return WrkRun(requests, duration_us / 1e6, sum(errors), p50_us / 1e6, p99_us / 1e6)

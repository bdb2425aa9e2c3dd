"""Never wrong KV from the connector: the layout id separates every setting that changes what a block's bytes mean
(one test per field, on a real VllmConfig); a step in which any load failed saves nothing (another request of the
step may have computed on the failed block); the shared memory is unregistered from CUDA before it is unmapped.
The vLLM parts run in the vLLM venv against a real agent process, through the real KvgateConnector."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from agent.layout_key import KvLayout
from bench.make_model import write_model
from bench.vllm_engine import ensure_vllm_venv
from tests.agent_process import AgentProcess
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(600)

BASE = KvLayout(model="m", revision=None, quantization=None, dtype="torch.bfloat16", kv_cache_dtype="auto",
                block_size=16, num_layers=2, num_kv_heads=2, head_size=32, tp_size=2, pp_size=2, tp_rank=0,
                pp_rank=0, attention_backend=None, kv_cache_layout="NHD")
OTHER: dict[str, Any] = dict(model="m2", revision="v2", quantization="fp8", dtype="torch.float16",
                             kv_cache_dtype="fp8_e4m3", block_size=32, num_layers=3, num_kv_heads=4, head_size=64,
                             tp_size=4, pp_size=4, tp_rank=1, pp_rank=1, attention_backend="FLASHINFER",
                             kv_cache_layout="HND", override="x")


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(KvLayout)])
def test_every_layout_field_changes_the_id(field: str) -> None:
    assert dataclasses.replace(BASE, **{field: OTHER[field]}).id() != BASE.id()
    assert dataclasses.replace(BASE).id() == BASE.id()


def run_in_vllm(script: str, *args: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([str(ensure_vllm_venv()), "-c", script, *args], env=env, capture_output=True, text=True,
                         timeout=500)
    assert out.returncode == 0, out.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# The connector's layout_id on a real VllmConfig, changed in one field at a time.
LAYOUT_SCRIPT = """
import copy, json, sys
from vllm.engine.arg_utils import EngineArgs
from agent.vllm_connector import layout_id

config = EngineArgs(model=sys.argv[1], max_model_len=512).create_engine_config()
config.cache_config.kv_cache_layout = "NHD"
base = layout_id(config, {}, 0, 0)
ids = {"same": layout_id(copy.deepcopy(config), {}, 0, 0), "tp_rank": layout_id(config, {}, 1, 0),
       "pp_rank": layout_id(config, {}, 0, 1)}
def changed(section, name, value):
    other = copy.deepcopy(config)
    object.__setattr__(getattr(other, section), name, value)
    return layout_id(other, {}, 0, 0)
ids["revision"] = changed("model_config", "revision", "0123abc")
ids["quantization"] = changed("model_config", "quantization", "fp8")
ids["kv_cache_dtype"] = changed("cache_config", "cache_dtype", "fp8_e4m3")
ids["kv_cache_layout"] = changed("cache_config", "kv_cache_layout", "HND")
from vllm.v1.attention.backends.registry import AttentionBackendEnum
ids["attention_backend"] = changed("attention_config", "backend", AttentionBackendEnum.FLEX_ATTENTION)
ids["override"] = layout_id(config, {"layout": "mine"}, 0, 0)
ids["override_pp_rank"] = layout_id(config, {"layout": "mine"}, 0, 1)
print(json.dumps({"base": base, "ids": ids}))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-config")
    write_model(path)  # the config is all a VllmConfig needs
    return path


@pytest.fixture(scope="module")
def vllm_layout_ids(model_dir: Path) -> dict[str, Any]:
    return run_in_vllm(LAYOUT_SCRIPT, str(model_dir))


@pytest.mark.parametrize("field", ["tp_rank", "pp_rank", "revision", "quantization", "kv_cache_dtype",
                                   "kv_cache_layout", "attention_backend", "override"])
def test_layout_id_of_a_real_vllm_config_separates(field: str, vllm_layout_ids: dict[str, Any]) -> None:
    """Before, the pipeline stage, revision, quantization, backend and cache layout were not in the id: stage 1
    would have loaded stage 0's bytes (valid checksum, wrong layers)."""
    ids = vllm_layout_ids["ids"]
    assert ids["same"] == vllm_layout_ids["base"]
    assert ids[field] != vllm_layout_ids["base"]
    assert ids["override_pp_rank"] != ids["override"]


# A worker-side KvgateConnector on CPU caches, driven step by step with metadata as the scheduler would send it.
STEP_SCRIPT = """
import json, sys
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig
from agent.client import AgentClient
from agent.vllm_connector import BlockTransfer, KvgateConnector, KvgateConnectorMetadata

model, socket = sys.argv[1], sys.argv[2]
extra = {"agent_socket": socket, "shm_bytes": 1 << 20, "async_transfers": False}  # loads inside the step
config = EngineArgs(model=model, max_model_len=512, kv_transfer_config={
    "kv_connector": "KvgateConnector", "kv_connector_module_path": "agent.vllm_connector", "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}).create_engine_config()
connector = KvgateConnector(config, KVConnectorRole.WORKER, KVCacheConfig(32, [], []))
caches = {f"l{i}": torch.randn(32, 2, 16, 64).to(torch.bfloat16) for i in range(2)}
connector.register_kv_caches(caches)

def step(loads, saves):
    connector.bind_connector_metadata(KvgateConnectorMetadata(loads=loads, saves=saves))
    connector.start_load_kv(None)
    connector.wait_for_save()
    connector.clear_connector_metadata()
    return sorted(connector.get_block_ids_with_load_errors())

out = {}
# request a loads two blocks the agent does not hold; request b, in the same step, computed two new blocks
out["errors"] = step([BlockTransfer("a", [0, 1], [101, 102])], [BlockTransfer("b", [5, 6], [201, 202])])
# a clean step: b's next blocks are kept
out["clean_errors"] = step([], [BlockTransfer("b", [7, 8], [301, 302])])
with AgentClient(socket, shm_bytes=0) as client:
    out["held_after_failed_step"] = client.lookup(connector._layout, [201, 202])[0]
    out["held_after_clean_step"] = client.lookup(connector._layout, [301, 302])[0]
stats = connector.get_kv_connector_stats()
out["stats"] = stats.data if stats is not None else {}
connector.shutdown()
print(json.dumps(out))
"""


def test_a_failed_load_keeps_every_save_of_its_step_out_of_the_agent(
        model_dir: Path, tmp_path: Path, agents: list[AgentProcess], subprocess_env: dict[str, str]) -> None:
    """Before, only the failed request's own saves were skipped: another request of the same step (which may
    have attended to the garbage block through a shared prefix) saved its blocks under correct hashes."""
    agent = AgentProcess(tmp_path, subprocess_env, "--dram-capacity", "4MiB")
    agents.append(agent)
    out = run_in_vllm(STEP_SCRIPT, str(model_dir), agent.socket)
    assert out["errors"] == [0, 1]
    assert out["held_after_failed_step"] == 0
    assert out["clean_errors"] == [] and out["held_after_clean_step"] == 2
    assert out["stats"]["save"] == {"after_failed_load": 1}
    assert out["stats"]["load"] == {"missing": 1}


# The block mover's registrations of its shared memory, recorded with whether the memory was mapped at the time.
PIN_SCRIPT = """
import json, sys
import torch
from agent.block_mover import BlockMover
from agent.client import AgentClient
from agent.kv_layout import describe_layers
from tests.mover_probe import mapped

class RecordingPinning:
    def __init__(self, error):
        self.events, self.error = [], error
    def register(self, address, size):
        self.events.append(["register", address, mapped(address)])
        return self.error
    def unregister(self, address):
        self.events.append(["unregister", address, mapped(address)])
        return 0

out = {}
caches = {f"l{i}": torch.randn(32, 2, 16, 64).to(torch.bfloat16) for i in range(2)}
for error in (0, 1):  # 1: the registration fails (cudaErrorInvalidValue)
    pinning = RecordingPinning(error)
    client = AgentClient(sys.argv[1], shm_bytes=1 << 20)
    mover = BlockMover(client, 7, describe_layers(caches, 32), pinning)
    assert mover.attach()
    first = mover._staging.tensor.data_ptr()
    client.close()  # a reconnect: the next save maps a new region
    assert mover.save([1, 2], [3, 4], None) is None
    assert mover.load([1, 2], [5, 6]).loaded == 2
    second = mover._staging.tensor.data_ptr()
    mover.close()
    out[str(error)] = {"events": pinning.events, "first": first, "second": second,
                       "mapped_after_close": mapped(second)}
print(json.dumps(out))
"""


def test_shared_memory_is_unregistered_before_it_is_unmapped(
        tmp_path: Path, agents: list[AgentProcess], subprocess_env: dict[str, str]) -> None:
    """Before, cudaHostRegister's result was ignored and the region never unregistered: a reconnect unmapped
    memory CUDA still had registered."""
    agent = AgentProcess(tmp_path, subprocess_env, "--dram-capacity", "4MiB")
    agents.append(agent)
    out = run_in_vllm(PIN_SCRIPT, agent.socket)
    ok = out["0"]
    first, second = ok["first"], ok["second"]
    assert ok["events"] == [["register", first, True], ["unregister", first, True],
                            ["register", second, True], ["unregister", second, True]]
    assert ok["mapped_after_close"] is False  # unmapped after, never before, its unregistration
    failed = out["1"]  # a failed registration is not undone (and the copies still work)
    assert [event[0] for event in failed["events"]] == ["register", "register"]


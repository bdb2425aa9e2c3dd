"""Diagnostic variants of the kvgate connector for bench/connector_throughput.py: the real KvgateConnector with one
of its costs taken away, so a paired run can say what the rest costs. Never for serving."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

from agent.vllm_connector import KvgateConnector, KvgateConnectorMetadata


class NoSaveConnector(KvgateConnector):
    """Plans no save: the lookups, the step's hooks and the transfer thread (idle) stay; the copies into shared
    memory, the agent's stores and the held requests go."""

    def _plan_save(self, meta: KvgateConnectorMetadata, req_id: str, computed_after_step: int,
                   block_ids: list[int] | None) -> None:
        return


class NoopConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's connector machinery alone: every lookup a miss at once, nothing loaded or saved, no agent, no thread."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

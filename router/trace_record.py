"""One line of a request trace: the Mooncake trace format (`timestamp`, `input_length`, `output_length`,
`hash_ids`), which `kvgate serve --record-trace` writes and `kvgate bench vsim` / `plan` replay, with the fields
a gateway knows and Mooncake lacks. Every field past Mooncake's four is optional, so plain Mooncake traces read
as they are; readers ignore fields they do not know.

`hash_ids` name the prompt's blocks of `block_tokens` tokens (512 when absent, as in Mooncake's traces), the last
one possibly partial: equal ids at equal positions mean equal prefixes (the ids are chained), nothing else about
the text can be read from them.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id when a line does not say


class TraceRecord(msgspec.Struct, omit_defaults=True):
    timestamp: Annotated[float, msgspec.Meta(ge=0)]  # arrival, ms since the trace (file) started
    input_length: Annotated[int, msgspec.Meta(ge=1)]  # prompt tokens, as the engine sees them
    output_length: Annotated[int, msgspec.Meta(ge=0)]  # generated tokens
    hash_ids: list[Annotated[int, msgspec.Meta(ge=0)]]
    block_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None  # tokens per hash id (None: Mooncake's 512)
    model: str | None = None
    tenant: int | None = None  # the cache namespace (cache_salt or tenant header), as a small id per file
    strategy: str | None = None
    worker: str | None = None  # the worker that answered (its URL)
    predicted_cached_tokens: int | None = None  # the strategy's prediction for the chosen worker
    cached_tokens: int | None = None  # what the engine reported (usage.prompt_tokens_details.cached_tokens)
    ttfb_ms: float | None = None  # arrival to the first byte from the worker
    duration_ms: float | None = None  # arrival to the last byte relayed
    status: int | None = None  # HTTP status relayed (499: the client went away)

    @property
    def tokens_per_id(self) -> int:
        return self.block_tokens or MOONCAKE_BLOCK_TOKENS

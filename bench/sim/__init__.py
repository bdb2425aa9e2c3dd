"""A simulated vLLM replica: vLLM's HTTP API, paged prefix cache, scheduler, KV events and metrics, with a
documented time model instead of a GPU (`kvgate sim`)."""

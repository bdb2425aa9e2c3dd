"""What the whole system shares: vLLM's KV-event wire format and publisher, vLLM's block hash, the typed
configuration machinery and the signal-aware runner. Imports nothing from router/, strategies/, agent/ or bench/."""

"""What the whole system shares: vLLM's KV-event wire format and publisher, vLLM's block hash, the typed
configuration machinery, the signal-aware runner and the OpenAI-style JSON errors of every HTTP port. Imports nothing
from router/, strategies/, agent/ or bench/."""

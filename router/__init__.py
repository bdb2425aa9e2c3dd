"""kvgate gateway: an OpenAI-compatible async proxy that routes each request to the warmest vLLM replica."""

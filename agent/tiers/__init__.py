"""The storage tiers of the agent, one module each, behind the `Tier` interface in `base`."""

"""The composition root: the `kvgate` command, and `kvgate serve`, which builds the configured strategy and hands
it to the gateway."""

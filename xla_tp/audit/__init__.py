"""Read what the XLA compiler did to a sharded program: collectives, bytes and FLOPs per device."""

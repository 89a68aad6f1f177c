"""`colossalai.pipeline`."""

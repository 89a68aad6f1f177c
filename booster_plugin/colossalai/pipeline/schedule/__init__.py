"""`colossalai.pipeline.schedule`."""

"""`colossalai.shardformer.policies`."""

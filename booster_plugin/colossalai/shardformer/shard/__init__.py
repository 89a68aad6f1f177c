"""`colossalai.shardformer.shard`."""

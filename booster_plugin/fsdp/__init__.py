"""The torch FSDP2 engine under GeminiPlugin and TorchFSDPPlugin: the mesh and `fully_shard` per layer, the boosted
model and optimizer."""

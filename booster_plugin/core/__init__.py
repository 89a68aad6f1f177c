"""The training core: the boosted module and optimizer, ZeRO, data-parallel gradient buckets, precision (fp16 loss
scale, torch AMP), microbatches, activation checkpointing, LoRA state. What a training step runs; imports the
guards only (never the plugins, the checkpoint IO or the compatibility adapters)."""

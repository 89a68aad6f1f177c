"""The plugins, ColossalAI's names and arguments: each composes the training core (core/), shardformer, the FSDP2
engine (fsdp/) and the checkpoint IO for one way of parallelizing. `config` turns HybridParallelPlugin's arguments
into typed options; `prepare` is its assembly of a model and optimizer for this rank (the order of the steps)."""

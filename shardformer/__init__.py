"""ShardFormer: per-model policies that pipeline- and tensor-parallelize unmodified transformers models."""
from .stage import loss_weights
from .policies import Colwise, Policy, Rowwise, VocabEmbedding, VocabHead, get_autopolicy
from .sharder import ShardConfig, Sharder

__all__ = ["loss_weights", "Policy", "Colwise", "Rowwise", "VocabEmbedding", "VocabHead", "get_autopolicy", "ShardConfig", "Sharder"]

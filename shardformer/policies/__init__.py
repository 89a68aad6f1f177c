from .auto_policy import SUPPORTED_MODELS, get_autopolicy
from .base import Colwise, Policy, Rowwise, VocabEmbedding, VocabHead

__all__ = ["Policy", "Colwise", "Rowwise", "VocabEmbedding", "VocabHead", "get_autopolicy", "SUPPORTED_MODELS"]

from .auto_policy import SUPPORTED_MODELS, get_autopolicy
from .base import Colwise, GradAllReduce, Policy, Rowwise, VocabEmbedding, VocabHead
from .plans import PlanPolicy, PlanRefused

__all__ = ["Policy", "Colwise", "Rowwise", "GradAllReduce", "VocabEmbedding", "VocabHead", "PlanPolicy",
           "PlanRefused", "get_autopolicy", "SUPPORTED_MODELS"]

"""Policies: what pipeline and tensor parallelism need to know of a model, from four front-ends side by side —
hand-written `Policy` subclasses (base.py; the built-in gpt2.py, bert.py, t5.py, bart.py), transformers' own plans
(from_transformers.py), Paddle-style plans (from_paddle.py) and Parallelformers-style block policies
(from_parallelformers.py)."""
from .auto_policy import SUPPORTED_MODELS, PlanSource, PolicyChoice, choose_policy, get_autopolicy
from .base import Colwise, GradAllReduce, Policy, Rowwise, VocabEmbedding, VocabHead
from .from_transformers import PlanRefused, TransformersPlanPolicy

__all__ = ["Policy", "Colwise", "Rowwise", "GradAllReduce", "VocabEmbedding", "VocabHead", "TransformersPlanPolicy",
           "PlanRefused", "get_autopolicy", "choose_policy", "PlanSource", "PolicyChoice", "SUPPORTED_MODELS"]

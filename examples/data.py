"""Offline data for the examples: text shipped with Python, a BPE tokenizer trained on the spot, token blocks."""
from __future__ import annotations

import ast
import os
import random
import re
import sysconfig
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from pydoc_data.topics import topics
from tokenizers import ByteLevelBPETokenizer, Tokenizer
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerFast

from booster_plugin import world_group

EOS, PAD = "<|endoftext|>", "<pad>"


def unwrap_lines(text: str) -> str:
    """Join the hard-wrapped lines of a paragraph (indented code lines and blank lines are kept)."""
    return re.sub(r"(?<=\S)\n(?=[^\s*=-])", " ", text)


def load_corpus(val_every: int = 10) -> Tuple[List[str], List[str]]:
    """The pydoc topics (Python's reference docs, ~465k characters): every `val_every`-th topic is validation."""
    docs = [unwrap_lines(topics[k]) for k in sorted(topics)]
    train = [d for i, d in enumerate(docs) if i % val_every]
    val = [d for i, d in enumerate(docs) if i % val_every == 0]
    return train, val


def train_tokenizer(texts: List[str], vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `texts` (a second or two), wrapped so that save_pretrained works."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, PAD],
                            show_progress=False)
    return _wrap(bpe._tokenizer)


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS, unk_token=EOS,
                                   pad_token=PAD)


def encode_stream(tokenizer: PreTrainedTokenizerFast, texts: List[str]) -> torch.Tensor:
    """All texts as one stream of token ids, each document followed by the end-of-text token."""
    ids: List[int] = []
    for enc in tokenizer(texts)["input_ids"]:
        ids.extend(enc)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


class TokenBlocks(Dataset):
    """Consecutive non-overlapping blocks of `seq_len` tokens for causal language modelling."""

    def __init__(self, ids: torch.Tensor, seq_len: int) -> None:
        self.blocks = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        ids = self.blocks[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def shared_tokenizer(texts: List[str], vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """train_tokenizer on rank 0, sent to the other ranks, so that every rank has the very same vocabulary."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return train_tokenizer(texts, vocab_size)
    blob = [train_tokenizer(texts, vocab_size).backend_tokenizer.to_str() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(blob, src=0, group=world_group())
    return _wrap(Tokenizer.from_str(blob[0]))


def lm_datasets(seq_len: int, vocab_size: int = 2048):
    """(tokenizer, train TokenBlocks, validation TokenBlocks) over the pydoc corpus."""
    train_texts, val_texts = load_corpus()
    tokenizer = shared_tokenizer(train_texts, vocab_size)
    return (tokenizer, TokenBlocks(encode_stream(tokenizer, train_texts), seq_len),
            TokenBlocks(encode_stream(tokenizer, val_texts), seq_len))


# -- a binary classification task: English documentation prose (0) or a line of Python source (1) ------------
def prose_sentences() -> List[str]:
    """Sentences of the pydoc topics' prose paragraphs (indented code examples and headings left out)."""
    sentences = []
    for text in topics.values():
        for para in text.split("\n\n"):
            if para.startswith((" ", "*", "=", "-")) or "::=" in para:
                continue
            for s in re.split(r"(?<=[.!?])\s+", " ".join(para.split())):
                if 30 <= len(s) <= 200:
                    sentences.append(s)
    return sentences


def code_lines(max_files: int = 40) -> List[str]:
    """Non-blank, non-docstring lines of (every fourth of) the standard library's own Python source files."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in os.listdir(stdlib) if f.endswith(".py"))[::4][:max_files]
    lines = []
    for name in files:
        with open(os.path.join(stdlib, name), encoding="utf-8", errors="ignore") as f:
            source = f.read()
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        doc_lines = set()  # line numbers of docstrings: they are prose, not code
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                    and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                doc_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
        for n, line in enumerate(source.splitlines(), 1):
            line = line.strip()
            if n not in doc_lines and 30 <= len(line) <= 200:
                lines.append(line)
    return lines


class TextPairs(Dataset):
    """Tokenized (text, label) pairs padded to `seq_len`, as dicts {input_ids, attention_mask, labels}."""

    def __init__(self, tokenizer, texts: List[str], labels: List[int], seq_len: int) -> None:
        self.enc = tokenizer(texts, padding="max_length", truncation=True, max_length=seq_len, return_tensors="pt")
        self.labels = torch.tensor(labels, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.enc["input_ids"][i], "attention_mask": self.enc["attention_mask"][i],
                "labels": self.labels[i]}


def prose_or_code_datasets(tokenizer, seq_len: int, n_train: int, n_val: int, seed: int = 0):
    """Balanced train/validation sets of the prose-or-code task (disjoint texts, same seed on every rank)."""
    rng = random.Random(seed)
    per_class = (n_train + n_val) // 2
    prose = rng.sample(prose_sentences(), per_class)
    code = rng.sample(code_lines(), per_class)
    pairs = [(t, 0) for t in prose] + [(t, 1) for t in code]
    rng.shuffle(pairs)
    train, val = pairs[:n_train], pairs[n_train:]
    return (TextPairs(tokenizer, [t for t, _ in train], [y for _, y in train], seq_len),
            TextPairs(tokenizer, [t for t, _ in val], [y for _, y in val], seq_len))

"""A synthetic token task with learnable structure, for training a GPT without a corpus.

Token sequences are walks of a fixed random Markov chain over the vocabulary: each token has
``BRANCHING`` possible successors (drawn once from ``seed``), taken with the probabilities ``WEIGHTS``. A
model that learns the chain predicts each next token with a cross entropy of ``entropy`` nats (1.11),
against ``ln(vocab_size)`` for a model that knows nothing, so the loss curve says how much it learnt.

Batch ``index`` of a split is drawn from ``(seed, split, index)`` alone: every rank can draw the global
batch and take its replica's rows, and a resumed run sees exactly the batches the uninterrupted run saw.
"""

from __future__ import annotations

import math

import torch

from hybridpar.errors import DataError

BRANCHING = 4
WEIGHTS = (0.55, 0.25, 0.15, 0.05)  # of the successors of a token, in the order they were drawn
SPLITS = {"train": 0, "val": 1}


class MarkovTokens:
    """Walks of a random Markov chain: ``batch(index, size)`` gives ``(idx, targets)``, each ``(size, T)``
    of ``torch.long``, where ``targets[:, t]`` is the token after ``idx[:, t]``."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0):
        if vocab_size < BRANCHING:
            raise DataError(f"the token task needs vocab_size >= {BRANCHING} (each token has {BRANCHING} "
                            f"successors); got {vocab_size}")
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.stack([torch.randperm(vocab_size, generator=g)[:BRANCHING]
                                       for _ in range(vocab_size)])  # (V, BRANCHING)
        self.weights = torch.tensor(WEIGHTS, dtype=torch.float64)

    @property
    def entropy(self) -> float:
        """The least cross entropy (nats per token) any model can reach on this task."""
        return -sum(p * math.log(p) for p in WEIGHTS)

    def batch(self, index: int, size: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + SPLITS[split] * 7_919 + index * 104_729 + 17)
        tokens = torch.empty(size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (size,), generator=g)
        choices = torch.multinomial(self.weights, size * self.seq_len, replacement=True, generator=g)
        choices = choices.view(size, self.seq_len)
        for t in range(self.seq_len):
            tokens[:, t + 1] = self.successors[tokens[:, t], choices[:, t]]
        return tokens[:, :-1], tokens[:, 1:]

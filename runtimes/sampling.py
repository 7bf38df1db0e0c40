"""Next-token choice from logits: greedy, or temperature / top-k / top-p (nucleus, Holtzman et al.
2020) sampling from a seeded ``numpy.random.Generator`` (the same seed gives the same tokens)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import K3Error


@dataclass
class Sampler:
    """temperature 0 is greedy (argmax); top_k 0 and top_p 1 keep every token."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise K3Error(f"--temperature {self.temperature}: give 0 (greedy) or a finite number above it")
        if self.top_k < 0:
            raise K3Error(f"--top-k {self.top_k}: give 0 (off) or more")
        if not 0 < self.top_p <= 1:
            raise K3Error(f"--top-p {self.top_p}: give a value in (0, 1]")
        if self.seed < 0:
            raise K3Error(f"--seed {self.seed}: give 0 or more")
        self.rng = np.random.default_rng(self.seed)

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution sampled from: softmax(logits / temperature) restricted to the top_k most
        likely tokens (and any tied with the k-th), then to the smallest most-likely set whose mass
        reaches top_p, renormalised. The largest logit is subtracted before dividing, so that a tiny
        temperature gives the greedy distribution rather than inf - inf."""
        z = np.asarray(logits, dtype=np.float64)
        with np.errstate(over="ignore"):   # -inf for the others is the right answer
            z = (z - z.max()) / self.temperature
        if 0 < self.top_k < z.size:
            z[z < np.partition(z, -self.top_k)[-self.top_k]] = -np.inf
        p = np.exp(z)
        p /= p.sum()
        if self.top_p < 1:
            order = np.argsort(-p, kind="stable")
            mass_before = np.cumsum(p[order]) - p[order]
            p[order[mass_before >= self.top_p]] = 0
            p /= p.sum()
        return p

    def __call__(self, logits: np.ndarray) -> int:
        if self.temperature == 0:
            return int(np.argmax(logits))
        p = self.probabilities(logits)
        return int(self.rng.choice(p.size, p=p))

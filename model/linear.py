"""The model's projections (docs/pipeline.md §6): ``nn.Linear`` without bias whose product is the
``k3::linear`` op (ops/linear.py), so that a compiled program reads each weight at the dtype it is
stored in and each target multiplies it its own way."""
from __future__ import annotations

from torch import nn

from ..ops.linear import linear


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        return linear(x, self.weight)

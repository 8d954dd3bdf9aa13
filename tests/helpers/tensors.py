"""Exact-value helpers for the algorithm tests: float64 tensors and a tight comparison."""
from __future__ import annotations

import math

import torch

D = torch.float64
NAN = float("nan")
LN = math.log


def t(x):
    return torch.tensor(x, dtype=D)


def close(a, b, atol=1e-6):
    torch.testing.assert_close(a, b if isinstance(b, torch.Tensor) else t(b), atol=atol, rtol=0)

"""The elementwise numerics the model and the ops' eager paths share: the fp32 upcast every fp32 step
uses (docs/model.md §1 step 9, §2-4) and the GLU activations of the experts and MLPs (docs/model.md §4)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("situ", "silu")   # what glu_act computes: SiTU (K3), SiLU-GLU (Kimi Linear)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 for the steps the model computes in fp32; a float64 x stays float64, so the whole
    model can run in double precision as a reference for its own fp32 rounding."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def situ(g: torch.Tensor, u: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """SiTU(g, u) = [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)]; |SiTU| <= b1*b2; -> SwiGLU as b -> inf."""
    g, u = upcast(g), upcast(u)
    return (beta1 * torch.tanh(g / beta1) * torch.sigmoid(g)) * (beta2 * torch.tanh(u / beta2))


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(upcast(g)) * upcast(u)


def glu_act(act: str, beta1: float, beta2: float, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The activation named by the config's ``hidden_act`` (ACTIVATIONS): "situ", else SwiGLU."""
    return situ(g, u, beta1, beta2) if act == "situ" else swiglu(g, u)

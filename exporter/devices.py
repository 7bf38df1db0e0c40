"""Expert parallelism in the exported program (README "Past one device"): the routed experts of
every MoE layer split into contiguous ranges, one per device (model/placement.py
``expert_ranges``), everything else on device 0.

Each MoE layer's ``experts`` becomes ``ShardedExperts``: one ``Experts`` of its range's size per
device, ``experts.d<k>.w1.weight_packed`` ..., which the layer bodies stack into the program
parameters ``layers.<group>.block_sparse_moe.experts.d<k>.w1.weight_packed`` [layers, E_k, ...]
(model/stacking.py ``shard_name``; the pack step writes each device's slice as its own parameter).
``ShardedMoE.routed`` sends (z, idx - start, w) to each device, runs ``k3::mxfp4_moe`` there on its
range (pairs of other devices' experts add nothing: ops/mxfp4_moe.py) and adds the partial sums on
device 0. The moves are ``k3dev::transfer`` placeholders; passes/devices.py makes them
``flow.tensor.transfer`` and pins every parameter to its device.
"""
from __future__ import annotations

import re

import torch
from torch import Tensor, nn

from ..model import K3Model
from ..model.moe import Experts, MoE
from ..model.placement import expert_ranges
from ..ops.mxfp4_moe import mxfp4_moe
from ..ops.numerics import upcast
from ..errors import K3Error

TRANSFER = "torch.k3dev.transfer"   # the placeholder in the imported module
SHARD = re.compile(r".*\.experts\.d(?P<d>\d+)\.w[123]\..*")


@torch.library.custom_op("k3dev::transfer", mutates_args=())
def transfer(x: Tensor, device: int) -> Tensor:
    """``x`` on device ``device`` of the program (eagerly: a copy)."""
    return x.clone()


@transfer.register_fake
def _(x, device):
    return torch.empty_like(x)


def device_of(name: str) -> int:
    """The device a (program or module) parameter lives on: k for a device's experts
    (``...experts.d<k>.w1...``), 0 for everything else."""
    m = SHARD.fullmatch(name)
    return int(m["d"]) if m else 0


class ShardedExperts(nn.Module):
    """The routed experts of one MoE layer as ``devices`` contiguous ranges, ``d<k>`` an ``Experts``
    of range k's size."""

    def __init__(self, experts: int, dim: int, hidden: int, devices: int):
        super().__init__()
        self.ranges = expert_ranges(experts, devices)
        for d, r in enumerate(self.ranges):
            self.add_module(f"d{d}", Experts(len(r), dim, hidden, True))


class ShardedMoE(MoE):
    """MoE whose routed experts run on the devices holding them (module docstring)."""

    def routed(self, z: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        cfg, y = self.cfg, None
        for d, r in enumerate(self.experts.ranges):
            ex = getattr(self.experts, f"d{d}")
            p = [t for n in ("w1", "w3", "w2") for t in (getattr(ex, n).weight_packed, getattr(ex, n).weight_scale)]
            # the ids are shifted on device d, where the lowering reads them to pick or skip each pair
            args = (upcast(z), idx, w) if d == 0 else (transfer(upcast(z), d), transfer(idx, d) - r.start, transfer(w, d))
            part = mxfp4_moe(*args, *p, cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
            y = part if d == 0 else y + transfer(part, 0)
        return y


def shard_experts(model: K3Model, devices: int) -> None:
    """Split the routed experts of every MoE layer of ``model`` (on the meta device: export reads no
    weight) over ``devices`` devices, in place."""
    cfg = model.cfg
    if not cfg.experts_mxfp4:
        raise K3Error("compile: --devices splits MXFP4 routed experts; this config's experts are not MXFP4")
    if cfg.num_experts < devices:
        raise K3Error(f"compile: --devices {devices} is more than the {cfg.num_experts} routed experts to split")
    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None:
            moe.__class__ = ShardedMoE
            with torch.device(moe.gate.weight.device):
                moe.experts = ShardedExperts(cfg.num_experts, cfg.expert_input_size, cfg.moe_intermediate_size,
                                             devices)

"""Stacked layouts of the weights: the checkpoint's, the module's and the compiled program's.

- Checkpoint: one tensor per routed expert, ``...block_sparse_moe.experts.{e}.w1.weight_packed``.
- K3Model: the experts of a layer stacked, ``...block_sparse_moe.experts.w1.weight_packed`` [E, ...]
  (gpt-fast's layout); ``to_checkpoint`` / ``from_checkpoint`` map between the two.
- Compiled program (exporter/, the pack step): the layers grouped by (attention kind, FFN kind), each
  per-layer tensor of a group stacked over its layers into ONE parameter ``layers.<group>.<name>``
  [n_layers_in_group, ...], read by one layer body per group with the layer's index in the group
  (docs/pipeline.md §5). Tensors outside the layers keep their names.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .config import K3Config

EXPERT = re.compile(r"(?P<head>.*\.experts)\.(?P<e>\d+)\.(?P<tail>w[123]\..*)")
LAYER = re.compile(r"model\.layers\.(?P<i>\d+)\.(?P<rest>.*)")


def to_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Module names -> checkpoint names: each stacked expert tensor [E, ...] split into E views."""
    out = {}
    for name, t in state.items():
        head, sep, tail = name.partition(".experts.")
        if sep and tail.startswith(("w1.", "w2.", "w3.")):
            out.update({f"{head}.experts.{e}.{tail}": t[e] for e in range(t.shape[0])})
        else:
            out[name] = t
    return out


def from_checkpoint(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names -> module names: per-expert tensors stacked in expert order."""
    out, experts = {}, {}
    for name, t in tensors.items():
        m = EXPERT.fullmatch(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(f"{m['head']}.{m['tail']}", {})[int(m["e"])] = t
    for name, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f"experts of {name} are not numbered 0..{len(by_index) - 1}")
        out[name] = torch.stack([by_index[e] for e in range(len(by_index))])
    return out


@dataclass(frozen=True)
class LayerGroup:
    """Layers that share one body: the same attention kind and FFN kind, in model order."""
    name: str                    # "<attention>_<ffn>", e.g. "kda_moe"
    layers: tuple[int, ...]      # 0-indexed model layers; a layer's index in the group is its position

    @property
    def attention(self) -> str:
        return self.name.split("_")[0]

    @property
    def moe(self) -> bool:
        return self.name.endswith("_moe")


def group_name(cfg: K3Config, layer: int) -> str:
    return f"{cfg.layer_kinds[layer]}_{'moe' if cfg.is_moe(layer) else 'dense'}"


def layer_groups(cfg: K3Config) -> dict[str, LayerGroup]:
    """Group name -> LayerGroup, in order of each group's first layer."""
    members: dict[str, list[int]] = {}
    for i in range(cfg.num_hidden_layers):
        members.setdefault(group_name(cfg, i), []).append(i)
    return {g: LayerGroup(g, tuple(layers)) for g, layers in members.items()}


def place(cfg: K3Config) -> list[tuple[str, int]]:
    """For each model layer: (its group's name, its index within the group)."""
    groups = layer_groups(cfg)
    return [(g, groups[g].layers.index(i)) for i in range(cfg.num_hidden_layers) for g in [group_name(cfg, i)]]


def stacked_name(group: str, name: str) -> str:
    """The program's parameter for per-layer tensor ``name`` (module layout) of a group."""
    return f"layers.{group}.{name}"


def shard_name(name: str, device: int) -> str:
    """The program parameter of ``device``'s range of the routed experts in a program over several
    devices (README "Past one device"): ``...experts.w1.weight_packed`` -> ``...experts.d1.w1.weight_packed``."""
    return name.replace(".experts.", f".experts.d{device}.", 1)


def program_name(places: list[tuple[str, int]], module_name: str) -> tuple[str, int | None]:
    """A K3Model tensor name -> (the program's parameter name, the layer's index in its group, or
    None for a tensor outside the layers); ``places`` is ``place(cfg)``."""
    m = LAYER.fullmatch(module_name)
    if m is None:
        return module_name, None
    group, index = places[int(m["i"])]
    return stacked_name(group, m["rest"]), index


def program_dtypes(cfg: K3Config, stored: dict[str, torch.dtype]) -> dict[str, torch.dtype]:
    """The stored dtype of each program parameter, from the checkpoint's (checkpoint name -> dtype).
    The layers stacked into one parameter must agree."""
    out: dict[str, torch.dtype] = {}
    places = place(cfg)
    for name, dtype in stored.items():
        m = EXPERT.fullmatch(name)
        program, _ = program_name(places, f"{m['head']}.{m['tail']}" if m else name)
        if out.setdefault(program, dtype) != dtype:
            raise ValueError(f"tensor '{name}' is stored as {dtype}, other layers of {program} as {out[program]}")
    return out


@dataclass(frozen=True)
class LayerRun:
    """Layers ``start .. start + period * count - 1`` whose groups repeat every ``period`` layers: the
    compiled program runs one body of ``period`` layers ``count`` times in a loop (docs/pipeline.md §5).
    A layer outside any repetition is a run of period 1 and count 1."""
    start: int
    period: int
    count: int

    def layers(self, k: int) -> range:
        """The model layers of iteration ``k``."""
        first = self.start + k * self.period
        return range(first, first + self.period)


MAX_PERIOD = 8


def layer_runs(cfg: K3Config) -> list[LayerRun]:
    """The layers as runs, in order: the one repetition that leaves the fewest layers to write out
    (layers in the loop body plus layers outside it), the layers before and after it one by one.
    K3 (93 layers): layer 0 (dense), 22 x [KDA, KDA, MLA, KDA], then layers 89-92."""
    n = cfg.num_hidden_layers
    names = [group_name(cfg, i) for i in range(n)]
    best = None                                           # (layers written out, run)
    for start in range(n):
        for period in range(1, MAX_PERIOD + 1):
            count = 1
            while (start + (count + 1) * period <= n
                   and names[start + count * period:start + (count + 1) * period] == names[start:start + period]):
                count += 1
            if count >= 2 and (best is None or n - (count - 1) * period < best[0]):
                best = (n - (count - 1) * period, LayerRun(start, period, count))
    if best is None:
        return [LayerRun(i, 1, 1) for i in range(n)]
    run = best[1]
    stop = run.start + run.period * run.count
    return [LayerRun(i, 1, 1) for i in range(run.start)] + [run] + [LayerRun(i, 1, 1) for i in range(stop, n)]

"""The decoder body written once per layer group, over stacked weights (docs/pipeline.md §5).

The exported entry points call one placeholder op per layer, ``torch.ops.k3x.kda_layer`` or
``k3x.mla_layer`` (``k3x.mla_layer_start`` where an MLA layer starts a sequence), with the layer's
activations, its state, ``at`` = [n, close] (int32: SPIR-V on llvmpipe gave NaN with an int64
index), the bank row of p and whether the layer closes a block, and ``j``, the layer's index in its
group, as a host integer. (``at`` is one tensor: IREE 3.13's interprocedural pass mixed up the
arguments when they came as scalars that coincide at some calls.) Each group's body (``LayerBody``)
is exported on its own: its weights are stacked parameters ``layers.<group>.<name>`` [n_layers, ...]
(model/stacking.py) and it takes layer ``j``'s slice of each. Because j is an integer on the host
(in a loop, an affine function of the loop's counter), the slice is an offset into the parameter:
each dispatch reads its layer's weights where they lie, with no gather and no copy.
passes/layer_calls.py turns every placeholder into a call of that body (which iree-compile still
inlines; that module says why).

The bank of Block Attention Residuals (docs/model.md §3) travels as one tensor E [R, B, T, D]: the
caller writes the running partial sum p at row n (the number of closed blocks) before each layer.
The body reads sources rows <= n (the closed blocks and p) for the attention's input; a layer that
closes a block (``close`` = 1) keeps p as a bank row and starts p afresh from the attention output,
so its FFN input mixes rows <= n and the new p; otherwise rows < n and p + attention output.
Rows beyond the sources are masked out of the softmax. Without AttnRes (Kimi Linear) E has one row.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch
from torch import Tensor, nn

from ..model import K3Model
from ..model.attnres import score
from ..model.linear import Linear
from ..model.norms import upcast
from ..model.stacking import LayerGroup, stacked_name
from .devices import device_of, transfer

# The layer code of the program being run: body key ("<group>.<form>") -> LayerBody, run key -> RunBody.
# The placeholders are torch.library ops, reachable from anywhere; their eager kernels look their
# code up here, and ``Program.forward`` sets it for the duration of its call.
_CODE: ContextVar[dict[str, nn.Module]] = ContextVar("k3c_layer_code")


@contextlib.contextmanager
def running(code: dict[str, nn.Module]):
    """The placeholders' eager kernels run ``code`` (body and run keys -> modules) inside this block."""
    token = _CODE.set(code)
    try:
        yield
    finally:
        _CODE.reset(token)


def _code(key: str) -> nn.Module:
    code = _CODE.get(None)
    if code is None or key not in code:
        raise RuntimeError(f"layer placeholder {key!r} called outside a Program that holds it")
    return code[key]


@torch.library.custom_op("k3x::kda_layer", mutates_args=())
def kda_layer(E: Tensor, at: Tensor, j: int, conv: Tensor, S: Tensor, body: str) -> tuple[Tensor, Tensor, Tensor]:
    """One KDA layer of a group: (E, at, j, conv [B, 3, HK, W-1], S [B, H, K, V]) -> (p, conv, S)."""
    return tuple(t.clone() for t in _code(body)(E, at, j, conv, S))


@kda_layer.register_fake
def _(E, at, j, conv, S, body):
    return E.new_empty(E.shape[1:]), torch.empty_like(conv), torch.empty_like(S)


@torch.library.custom_op("k3x::mla_layer", mutates_args=())
def mla_layer(E: Tensor, at: Tensor, j: int, cache: Tensor, body: str) -> tuple[Tensor, Tensor]:
    """One MLA layer continuing a sequence: cache [B, L, W] of the tokens before -> (p, the cache rows
    of the T new tokens [B, T, W]; the caller appends them)."""
    return tuple(t.clone() for t in _code(body)(E, at, j, cache))


@mla_layer.register_fake
def _(E, at, j, cache, body):
    B, L, W = cache.shape
    return E.new_empty(E.shape[1:]), cache.new_empty(B, E.shape[2], W)


@torch.library.custom_op("k3x::mla_layer_slots", mutates_args=())
def mla_layer_slots(E: Tensor, at: Tensor, j: int, cache: Tensor, valid: Tensor, body: str) -> tuple[Tensor, Tensor]:
    """One MLA layer's decode step over sequences of different lengths: cache [B, L, W] of the
    longest, valid [B, L] marking each sequence's rows -> (p, the new rows [B, 1, W])."""
    return tuple(t.clone() for t in _code(body)(E, at, j, cache, valid))


@mla_layer_slots.register_fake
def _(E, at, j, cache, valid, body):
    B, L, W = cache.shape
    return E.new_empty(E.shape[1:]), cache.new_empty(B, E.shape[2], W)


@torch.library.custom_op("k3x::mla_layer_start", mutates_args=())
def mla_layer_start(E: Tensor, at: Tensor, j: int, width: int, body: str) -> Tensor:
    """One MLA layer starting a sequence (no cache before) -> [p | cache], [B, T, D + width]: one
    result, because IREE 3.13's interprocedural pass loses the size of a second result of the
    same dynamic length ("operand is unlinked")."""
    return _code(body)(E, at, j)[0].clone()


@mla_layer_start.register_fake
def _(E, at, j, width, body):
    return E.new_empty(E.shape[1], E.shape[2], E.shape[3] + width)


@torch.library.custom_op("k3x::layer_loop", mutates_args=())
def layer_loop(carry: list[Tensor], given: list[Tensor], count: int, run: str) -> list[Tensor]:
    """``count`` iterations k = 0, 1, ... of the run body ``run`` (``RunBody``), each taking
    (k, *carry, *given) and returning the next carry. passes/layer_calls.py makes it an scf.for."""
    for k in range(count):
        carry = _code(run)(torch.tensor([k], device=carry[0].device), *carry, *given)
    return [t.clone() for t in carry]


@layer_loop.register_fake
def _(carry, given, count, run):
    return [torch.empty_like(t) for t in carry]


def attn_res_masked(V: Tensor, valid: Tensor, w: Tensor, gamma: Tensor) -> Tensor:
    """AttnRes (docs/model.md §3) over the rows of V [R, B, T, D] where ``valid`` [R] is true."""
    s = score(V, w, gamma).masked_fill(~valid.view(-1, 1, 1), -torch.inf)
    alpha = s.softmax(dim=0)
    return (alpha.unsqueeze(-1) * upcast(V)).sum(0).to(V.dtype)


class LayerStep(nn.Module):
    """One decoder layer as a function of the bank tensor (module docstring); its weights are the
    template layer's, replaced by the body with layer j's slices."""

    def __init__(self, model: K3Model, layer: int, decode: bool):
        super().__init__()
        self.layer, self.decode, self.attn_res = model.model.layers[layer], decode, model.cfg.uses_attn_res

    def forward(self, E, at, *state):
        layer, n, close = self.layer, at[0], at[1]
        p = E.index_select(0, n.reshape(1)).squeeze(0)
        rows = torch.arange(E.shape[0], dtype=at.dtype, device=E.device)
        x = attn_res_masked(E, rows <= n, layer.self_attention_res_proj.weight,
                            layer.self_attention_res_norm.weight) if self.attn_res else p
        h = layer.input_layernorm(x)
        if layer.kind == "kda":
            conv, S = state
            a, conv_out, S = layer.self_attn(h, conv.unbind(1), S, self.decode)
            new_state = (torch.stack(conv_out, dim=1), S)
        else:   # state: (), (cache,) or, decoding sequences of different lengths, (cache, valid)
            a, latent = layer.self_attn(h, state[0] if state else None, self.decode, *state[1:])
            new_state = (latent,)
        if not self.attn_res:
            p = p + a
            return self.results(p + layer.ffn(p), new_state, state)
        keep = 1 - close.to(p.dtype)
        p = a + keep * p                                   # closing: p restarts from a; else p + a
        V = torch.cat((E, p.unsqueeze(0)), dim=0)
        valid = torch.cat((rows < n + close, rows.new_ones(1, dtype=torch.bool)))
        x = attn_res_masked(V, valid, layer.mlp_res_proj.weight, layer.mlp_res_norm.weight)
        return self.results(p + layer.ffn(x), new_state, state)

    def results(self, p, new_state, state):
        """(p, *state) (an MLA layer's state: the cache rows of its T tokens), or (p | cache,) for an MLA
        layer that starts a sequence (mla_layer_start)."""
        if self.layer.kind == "mla" and not state:
            return (torch.cat((p, new_state[0].to(p.dtype)), dim=-1),)
        return (p, *new_state)


class LayerBody(nn.Module):
    """Every layer of ``group`` as one function of the layer index j (an integer): weights stacked
    [n, ...] as buffers ``w0, w1, ...`` (``names[i]`` is the per-layer tensor name of ``w{i}``), at
    their stored dtypes (``stored``: program parameter -> dtype), widened after layer j is sliced
    (the weights of ``Linear`` projections are not: k3::linear multiplies them as stored).
    With ``weights`` the buffers hold the model's weights stacked (to run it eagerly); otherwise they
    live on the meta device (to export it)."""

    def __init__(self, model: K3Model, group: LayerGroup, decode: bool, stored: dict | None = None,
                 weights: bool = False):
        super().__init__()
        self.step = LayerStep(model, group.layers[0], decode)
        self.group = group
        layers = model.model.layers
        self.names = list(self.step.layer.state_dict())
        # the dtype each weight is widened to after slicing; None for a Linear layer's weight, which
        # k3::linear multiplies at its stored dtype (ops/linear.py)
        self.widen_to = [None if _linear_weight(self.step.layer, name) else t.dtype
                         for name, t in self.step.layer.state_dict().items()]
        for i, name in enumerate(self.names):
            parts = [layers[l].state_dict()[name] for l in group.layers]
            dtype = (stored or {}).get(stacked_name(group.name, name), parts[0].dtype)
            self.register_buffer(f"w{i}", torch.stack(parts).to(dtype) if weights else
                                 torch.empty(len(parts), *parts[0].shape, dtype=dtype, device="meta"))
        object.__setattr__(self, "template", self.step)  # the template's own weights are never lifted
        del self.step

    def parameter_names(self) -> dict[str, str]:
        """Exported buffer name -> the program's parameter name."""
        return {f"w{i}": stacked_name(self.group.name, name) for i, name in enumerate(self.names)}

    def forward(self, E, at, j, *state):
        torch._check(j >= 0)
        torch._check(j < len(self.group.layers))
        weights = {}
        for i, (name, dtype) in enumerate(zip(self.names, self.widen_to)):
            w = self.layer_slice(i, name, j).squeeze(0)
            weights[f"layer.{name}"] = w if dtype is None else w.to(dtype)
        return torch.func.functional_call(self.template, weights, (E, at, *state), strict=True)

    def layer_slice(self, i: int, name: str, j) -> Tensor:
        """Layer j of stacked buffer ``w{i}``: an offset into it. Over several devices a device's
        experts (exporter/devices.py) are sliced on that device by an index sent there, so the
        weights never move."""
        device, w = device_of(name), getattr(self, f"w{i}")
        if device:
            return w.index_select(0, transfer(torch.full((1,), j, dtype=torch.int32, device=w.device), device))
        return w.narrow(0, j, 1)


def _linear_weight(layer: nn.Module, name: str) -> bool:
    """Whether ``name`` is the weight of one of ``layer``'s ``Linear`` projections."""
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and isinstance(layer.get_submodule(module), Linear)


def _bounded(i, size: int):
    """An integer computed on the host (an unbacked integer in torch.export) as an index into a
    dimension of ``size``: bounded for the checks of select and slice_scatter."""
    torch._check(i >= 0)
    torch._check(i < size)
    return i


def _affine(values: list[list[int]], what: str) -> tuple[list[int], list[int]]:
    """Per-iteration values [k][o] as v0[o] + k * dv[o]; ValueError where they are not affine in k."""
    v0, dv = values[0], [b - a for a, b in zip(values[0], values[1] if len(values) > 1 else values[0])]
    if any(v != [a + k * d for a, d in zip(v0, dv)] for k, v in enumerate(values)):
        raise ValueError(f"{what} is not affine in the iteration")
    return v0, dv


def _put(stack: Tensor, value: Tensor, i) -> Tensor:
    """``stack`` with ``stack[i] = value`` (i a run-time index). As a one-row slice_scatter, which
    torch-mlir lowers to tensor.insert_slice and IREE to an in-place update of that row: the same
    select_scatter becomes a select over the whole stack, a pass over every layer's state per layer."""
    return stack.slice_scatter(value.unsqueeze(0), 0, i, i + 1)


class RunBody(nn.Module):
    """One iteration k of a layer run (model/stacking.py ``LayerRun``): its ``period`` layers, each a
    placeholder call of its group's body. Every per-layer position is an integer computed on the
    host from k, so the same code serves every iteration: the model layer i, its index j in the
    group and its state slot are affine in k; the bank row n and whether the layer closes a block
    follow from i and the AttnRes block size. Nothing is read back from the device to index the
    state (docs/pipeline.md §5: such reads inside a loop came back wrong on Vulkan), except in a
    program over several devices, which has no loop (``forward``). The carry is
    (E, p, *new state stacks[, hidden]); ``given`` are the state stacks the entry point received
    (none in prefill), named by ``program.given_names`` (a decode step of pooled sequences also
    gives ``valid``, each sequence's cache rows, for the MLA layers). New state is written into its stack at the layer's slot (for MLA the cache
    rows of the T tokens: the entry point appends them to the given caches at the end)."""

    def __init__(self, program, run, key: str):
        super().__init__()
        cfg = program.cfg
        self.cfg, self.run, self.key = cfg, run, key
        object.__setattr__(self, "program", program)   # not a submodule: its weights are not the run's
        layers = [list(run.layers(k)) for k in range(run.count)]
        self.j0, self.dj = _affine([[program.places[i][1] for i in ls] for ls in layers],
                                   f"layer run {run}: a layer's index in its group")
        self.slot0, self.dslot = _affine([[program.slots[i] for i in ls] for ls in layers],
                                         f"layer run {run}: a layer's state slot")
        self.table = [[[*self.bank_position(i), program.slots[i], i] for i in ls] for ls in layers]

    def bank_position(self, i):
        """(n, close) of model layer i: its bank row, sum(closes_block(l) for l < i), and whether it
        closes a block (i % B == 0), from i alone: n = ceil(i / B), close = 1 - (ceil(i / B) - floor(i / B))."""
        if not self.cfg.uses_attn_res:
            return 0, 0
        B = self.cfg.attn_res_block_size
        n = (i + B - 1) // B
        return n, 1 - (n - i // B)

    def forward(self, k, *tensors):
        program, cfg = self.program, self.cfg
        names = program.state_names
        E, p = tensors[:2]
        new = dict(zip(names, tensors[2:2 + len(names)]))
        hidden = tensors[2 + len(names)] if program.mode == "prefill" else None
        given = dict(zip(program.given_names, tensors[2 + len(names) + (hidden is not None):]))
        # a run of one iteration is called once, outside any loop: its positions are constants
        iteration = 0 if self.run.count == 1 else _bounded(k.item(), self.run.count)   # the loop's counter
        # each layer's row [n, close, slot, i], gathered at row k of a table on k's device: the
        # bodies take (n, close) from it as a tensor. A program over several devices also reads
        # n, slot and i from it (every layer of it is written out): with them computed on the host,
        # k3-tiny over 2 CPU devices computed wrong logits from its prefill (not explained yet)
        rows = torch.tensor(self.table, dtype=torch.int32).to(k.device).index_select(0, k).squeeze(0)
        D = p.shape[-1]
        for o, layer in enumerate(self.run.layers(0)):
            j = self.j0[o] + iteration * self.dj[o]
            kind = cfg.layer_kinds[layer]
            sizes = (E.shape[0], program.slots_of[kind], cfg.num_hidden_layers)
            if program.devices > 1:
                n, slot, i = (_bounded(rows[o, c].item(), size) for c, size in zip((0, 2, 3), sizes))
            else:
                i = _bounded(layer + iteration * self.run.period, cfg.num_hidden_layers)
                slot = _bounded(self.slot0[o] + iteration * self.dslot[o], sizes[1])
                n = _bounded(self.bank_position(i)[0], sizes[0])
            at = rows[o, :2]
            E = _put(E, p, n)
            body = program.body(program.places[layer][0], kind)
            if kind == "kda":
                conv, S = ((given[s].select(0, slot) if given else torch.zeros_like(new[s][0]))
                           for s in ("kda_conv", "kda_S"))
                p, conv, S = torch.ops.k3x.kda_layer(E, at, j, conv, S, body)
                new["kda_conv"] = _put(new["kda_conv"], conv, slot)
                new["kda_S"] = _put(new["kda_S"], S, slot)
            else:
                if "valid" in given:
                    p, cache = torch.ops.k3x.mla_layer_slots(E, at, j, given["mla_cache"].select(0, slot),
                                                             given["valid"], body)
                elif given:
                    p, cache = torch.ops.k3x.mla_layer(E, at, j, given["mla_cache"].select(0, slot), body)
                else:
                    p, cache = torch.ops.k3x.mla_layer_start(E, at, j, cfg.mla_cache_width, body).split(
                        (D, cfg.mla_cache_width), dim=-1)
                new["mla_cache"] = _put(new["mla_cache"], cache.to(new["mla_cache"].dtype), slot)
            if hidden is not None:
                hidden = _put(hidden, p, i)
        return (E, p, *new.values(), *([] if hidden is None else [hidden]))

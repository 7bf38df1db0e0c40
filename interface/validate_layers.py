"""``k3c validate --layers``: each layer of a bundle checked on its own, where no reference run of
the whole model fits in memory (docs/bundle.md §7).

For every model layer i, seeded random inputs of the shapes its group's layer entry point takes
(exporter/export.py ``layer_function``): the bank E [R, 1, T, D] with the partial sum at row n_i
(rows after it random too: the entry must mask them out), a random KDA state, T tokens crossing
the CPU's 256-token KDA blocks. The compiled entry runs with at = [n_i, close_i, j_i] on the
module's stacked parameters (the archive); the eager layer (model/model.py ``decoder_step``) runs
on layer i's tensors alone, read from the checkpoint (model/checkpoint.py ``load_layer``), and is
dropped before the next; the pages of the archive and of the checkpoint that the layer read are
given back (utils/memory.py), so memory holds one layer whatever the depth. A layer passes when
every output (p, and the new state) is finite and within the target's validation tolerance in max
abs error.
"""
from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..artifacts.bundle import Bundle
from ..errors import K3Error
from ..runtimes.session import Session
from ..utils.memory import release_mapped_pages
from .validate import TOLERANCE

LAYER_TOKENS = 300   # one whole 256-token KDA block on the CPU and part of a second


@dataclass
class LayerCheck:
    layer: int
    kind: str              # "<attention>_<ffn>": the layer's group
    max_abs: float         # over its outputs: p and the new state
    max_rel: float         # the largest of each output's max abs error / max |eager|
    passed: bool
    finite: bool = True


def _inputs(cfg, i: int, rows: int, tokens: int, gen) -> tuple:
    """Random (E, state) for layer i: E [rows, 1, T, D]; KDA: conv [1, 3, HK, W-1], S [1, H, K, K]."""
    import torch
    E = torch.randn(rows, 1, tokens, cfg.hidden_size, generator=gen)
    if cfg.layer_kinds[i] != "kda":
        return E, ()
    H, K, W = cfg.kda_heads, cfg.kda_head_dim, cfg.conv_size
    conv = torch.randn(1, 3, H * K, W - 1, generator=gen)
    S = 0.1 * torch.randn(1, H, K, K, generator=gen)
    return E, (conv, S)


def _eager(cfg, ckpt, i: int, n: int, E, state: tuple) -> list:
    """Layer i run eagerly on its own weights: [p, conv, S] (KDA) or [p | cache] (MLA starting a sequence)."""
    import torch

    from ..model.checkpoint import load_layer
    from ..model.model import K3State, decoder_step

    layer = load_layer(ckpt, cfg, i)
    st = K3State([state[0]], [state[1]], []) if state else K3State([], [], [None])
    with torch.no_grad():
        p = decoder_step(cfg, layer, i, list(E[:n]), E[n], st, 0, False)
    if state:
        return [p, st.kda_conv[0], st.kda_S[0]]
    return [torch.cat((p, st.mla_cache[0].to(p.dtype)), dim=-1)]


def _compare(i: int, kind: str, got: list[np.ndarray], want: list, tol: float) -> LayerCheck:
    errs, rels, finite = [], [], True
    for g, w in zip(got, want):
        w = w.double().numpy()
        g = g.astype(np.float64).reshape(w.shape)
        finite &= bool(np.isfinite(g).all())
        err = float(np.abs(g - w).max())
        errs.append(err)
        rels.append(err / max(float(np.abs(w).max()), 1e-30))
    err = max(errs)
    return LayerCheck(i, kind, err, max(rels), finite and err <= tol, finite)


def validate_layers(bundle: Bundle, checkpoint: Path | None = None, *, tokens: int = LAYER_TOKENS,
                    seed: int = 0, log=print) -> tuple[list[LayerCheck], int]:
    """Every layer of ``bundle`` checked on its own (module docstring) against the checkpoint at
    ``checkpoint`` (default the bundle's), which must have the bundle's config. Returns the checks
    and this process's peak RSS in bytes."""
    import torch  # deferred heavy import (~2 s): only validation runs the PyTorch layers

    from ..exporter.export import layer_function
    from ..model.checkpoint import checkpoint_dir, checkpoint_files, open_checked
    from ..model.config import K3Config
    from ..model.stacking import group_name, place

    m = bundle.manifest
    ck = bundle.checkpoint_dir if checkpoint is None else checkpoint_dir(checkpoint)
    cfg = K3Config.from_hf(ck)
    if cfg.hash != m.config_hash:
        raise K3Error(f"validate: checkpoint {ck} has config {cfg.hash}, {bundle.root} was compiled for {m.config_hash}")
    _, ckpt = open_checked(ck)                      # headers only: the model is on the meta device
    missing = [layer_function(g) for g in sorted(set(g for g, _ in place(cfg))) if layer_function(g) not in m.entry_points]
    if missing:
        raise K3Error(f"validate: {bundle.root} has no layer entry point {missing[0]} (compiled before "
                      "k3c validate --layers); compile it again")
    session = Session(bundle)
    tol = TOLERANCE[m.target["backend"]]
    T = min(tokens, m.max_prompt)
    closes = [int(cfg.closes_block(i)) for i in range(cfg.num_hidden_layers)]
    rows = sum(closes) + 1
    gen = torch.Generator().manual_seed(seed)
    mapped = [*bundle.parameter_files, *checkpoint_files(ck)]
    checks = []
    for i, (group, j) in enumerate(place(cfg)):
        n = sum(closes[:i])
        E, state = _inputs(cfg, i, rows, T, gen)
        at = np.array([n, closes[i], j], dtype=np.int32)
        got = session.layer(layer_function(group), E.numpy(), at, *(s.numpy() for s in state))
        checks.append(_compare(i, group_name(cfg, i), got, _eager(cfg, ckpt, i, n, E, state), tol))
        release_mapped_pages(mapped)
        c = checks[-1]
        log(f"layer {i} ({c.kind}): max abs {c.max_abs:.2e}, max rel {c.max_rel:.2e}, "
            f"{'PASS' if c.passed else 'FAIL'}")
    return checks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

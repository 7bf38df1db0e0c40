"""fla-core's pure-PyTorch KDA references, loaded without importing ``fla`` (whose package import
pulls in triton, absent on CPU machines).

``fla/ops/kda/naive.py`` needs only torch and einops, so it is loaded by file path. The two gate
references live in ``fla/ops/kda/gate.py`` next to triton kernels: their ``def`` nodes are taken
from the parsed source and compiled alone, so none of that module's imports run.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F

GATE_FUNCTIONS = ("naive_kda_gate", "naive_kda_lowerbound_gate")


def fla_root() -> Path:
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("fla-core is not installed (pip install fla-core==0.6.0)")
    return Path(next(iter(spec.submodule_search_locations)))


def load_naive():
    """The module ``fla/ops/kda/naive.py``: naive_recurrent_kda and naive_chunk_kda."""
    path = fla_root() / "ops" / "kda" / "naive.py"
    spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_gates() -> dict:
    """naive_kda_gate and naive_kda_lowerbound_gate from ``fla/ops/kda/gate.py``, compiled alone."""
    path = fla_root() / "ops" / "kda" / "gate.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    defs = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in GATE_FUNCTIONS]
    if {d.name for d in defs} != set(GATE_FUNCTIONS):
        raise ImportError(f"{path} no longer defines {', '.join(GATE_FUNCTIONS)}")
    namespace = {"torch": torch, "F": F}
    exec(compile(ast.Module(body=defs, type_ignores=[]), str(path), "exec"), namespace)
    return {name: namespace[name] for name in GATE_FUNCTIONS}

"""What ships, tested as it ships: each k3 custom op lowered by its target's own pipeline
(``Pipeline.for_target``) and run on that target at token counts that cross its blocks; ``k3c validate
--per-layer`` on a real bundle; 64 decode steps of the compiled model; and commands that print no
third-party warnings.

Every CPU level this host can execute runs them (an AVX-512 host runs the AVX2 level's code too).
The CPU lowers ``kda_chunk`` in 256-token blocks of 16-token chunks, the other targets in 64-token
chunks: T = 1, 255, 257 and 600 run a lone token, a block one short, a block and one token, and
three blocks with a partial one, all from one module per target. The references are the independent
ones of test_compiled_ops.py: fla's naive recurrent KDA and MXFP4 (dequantised) or bf16 experts
multiplied in float64.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from test_compiled_ops import (K, as_numpy, bf16_linear_inputs, expert_weights, fla_recurrent, float_expert_weights,
                               float_moe, float_moe_reference, kda_inputs, linear_reference, moe, moe_reference,
                               routed_tokens)
from torch.export import Dim, export

from k3c.model import K3Config  # registers torch.ops.k3.*
from conftest import cpu_target, needs_vulkan_run  # tests/ is on sys.path
from k3c.runtimes import readback
from k3c.runtimes.readback import DeviceFunction, read_back

K3C = Path(sys.executable).with_name("k3c")  # the console script installed beside this interpreter
TOKENS = [1, 255, 257, 600]
LINEAR_OUT, LINEAR_IN = 48, 96   # 3 tiles of 16 (6 of 8) outputs, 3 blocks of 32 inputs
TARGETS = [cpu_target("cpu:x86-64"), cpu_target("cpu:x86-64-v3"), cpu_target("cpu:x86-64-v4"),
           pytest.param("vulkan", marks=needs_vulkan_run)]
# max abs error against the float64 references: as in test_compiled_ops.py (CPU) and test_targets.py (Vulkan)
TOLERANCE = {"local-task": 2e-5, "vulkan": 1e-4}


def k3c(*args, cache_dir: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"K3C_CACHE": str(cache_dir)} if cache_dir else {})}
    return subprocess.run([str(K3C), *map(str, args)], capture_output=True, text=True, timeout=900, env=env)


def warning_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "Warning" in line]


@cache
def compiled(op: str, spec: str, dynamic: bool):
    """``op`` ('kda_chunk', 'kda_step', 'moe', 'float_moe' or 'linear') exported alone, lowered by ``Pipeline.for_target``
    and compiled for ``spec``; returns (run: numpy arrays -> host arrays, the function on the device,
    driver). Dynamic: the token count is a run-time dimension (prefill forms)."""
    import iree.runtime as rt
    from iree.compiler import ir
    from iree.compiler.extras.fx_importer import FxImporter

    from k3c.passes.pipeline import Pipeline
    from k3c.compiler.targets import compile_mlir, parse_target

    target = parse_target(spec)
    T = Dim("T", min=1, max=1024)
    if op == "moe":
        fn, example = moe, (*routed_tokens(4 if dynamic else 1, seed=0), *expert_weights(0))
        shapes = ({0: T},) * 3 + (None,) * 6 if dynamic else None
    elif op == "float_moe":
        fn, example = float_moe, (*routed_tokens(4 if dynamic else 1, seed=0), *float_expert_weights(0))
        shapes = ({0: T},) * 3 + (None,) * 3 if dynamic else None
    elif op == "linear":
        fn, example = torch.ops.k3.linear, bf16_linear_inputs(3 if dynamic else 1, LINEAR_OUT, LINEAR_IN, seed=0)
        shapes = ({1: T}, None) if dynamic else None
    else:
        fn, example = getattr(torch.ops.k3, op), kda_inputs(3 if dynamic else 1, seed=0)
        shapes = ({1: T},) * 5 + (None,) if dynamic else None

    class Op(torch.nn.Module):
        def forward(self, *args):
            return fn(*args)

    program = export(Op(), example, dynamic_shapes=(shapes,) if shapes else None)
    context = ir.Context()
    importer = FxImporter(context=context)
    with context:
        importer.import_program(program, func_name="main")
    Pipeline.for_target(target).run(importer.module, log=lambda _: None)
    vmfb = compile_mlir(str(importer.module), target, log=lambda _: None)
    config = rt.Config(target.driver)
    main = DeviceFunction(readback.load(config, rt.VmModule.copy_buffer(config.vm_instance, vmfb)), "module", "main")

    def run(*arrays):
        out = [read_back(main.device, o) for o in main(*arrays)]
        return tuple(out) if len(out) > 1 else out[0]

    return run, main, target.driver


@pytest.mark.slow
@pytest.mark.parametrize("spec", TARGETS)
def test_kda_chunk_as_shipped(spec, fla_naive):
    run, _, driver = compiled("kda_chunk", spec, dynamic=True)
    for T in TOKENS:
        q, k, v, g, beta, S0 = kda_inputs(T, seed=T)
        o, S = run(*(t.numpy() for t in (q * K ** -0.5, k, v, g, beta, S0)))
        o_ref, S_ref = fla_recurrent(fla_naive, q, k, v, g, beta, S0)
        np.testing.assert_allclose(o, o_ref, rtol=0, atol=TOLERANCE[driver], err_msg=f"o at T = {T}")
        np.testing.assert_allclose(S, S_ref, rtol=0, atol=TOLERANCE[driver], err_msg=f"S at T = {T}")


@pytest.mark.slow
@pytest.mark.parametrize("spec", TARGETS)
def test_kda_step_as_shipped(spec, fla_naive):
    """T decode steps, the state left on the device between calls, as a session keeps it."""
    _, main, driver = compiled("kda_step", spec, dynamic=False)
    for T in TOKENS:
        q, k, v, g, beta, S0 = kda_inputs(T, seed=T)
        qs = q * K ** -0.5
        S, outs = S0.numpy(), []
        for t in range(T):
            o, S = main(*(np.ascontiguousarray(x[:, t:t + 1].numpy()) for x in (qs, k, v, g, beta)), S)
            outs.append(read_back(main.device, o))
        o_ref, S_ref = fla_recurrent(fla_naive, q, k, v, g, beta, S0)
        np.testing.assert_allclose(np.concatenate(outs, axis=1), o_ref, rtol=0, atol=TOLERANCE[driver],
                                   err_msg=f"o over {T} steps")
        np.testing.assert_allclose(read_back(main.device, S), S_ref, rtol=0, atol=TOLERANCE[driver],
                                   err_msg=f"S after {T} steps")


def check_experts_as_shipped(op: str, spec: str, weights, host_weights, reference) -> None:
    """The prefill form (token count dynamic) at every T, and the decode form (one token)."""
    run, _, driver = compiled(op, spec, dynamic=True)
    for n_tokens in TOKENS:
        z, idx, w = routed_tokens(n_tokens, seed=n_tokens)
        y = run(z.numpy(), idx.numpy(), w.numpy(), *host_weights)
        np.testing.assert_allclose(y, reference(z, idx, w, weights), rtol=0, atol=TOLERANCE[driver],
                                   err_msg=f"{n_tokens} tokens")
    run, _, driver = compiled(op, spec, dynamic=False)
    z, idx, w = routed_tokens(1, seed=7)
    y = run(z.numpy(), idx.numpy(), w.numpy(), *host_weights)
    np.testing.assert_allclose(y, reference(z, idx, w, weights), rtol=0, atol=TOLERANCE[driver])


@pytest.mark.slow
@pytest.mark.parametrize("spec", TARGETS)
def test_mxfp4_moe_as_shipped(spec):
    weights = expert_weights(2)
    check_experts_as_shipped("moe", spec, weights, [t.numpy() for t in weights], moe_reference)


@pytest.mark.slow
@pytest.mark.parametrize("spec", TARGETS)
def test_float_moe_as_shipped(spec):
    """bf16 experts, as Kimi Linear stores them."""
    weights = float_expert_weights(2)
    check_experts_as_shipped("float_moe", spec, weights, [as_numpy(t) for t in weights], float_moe_reference)


@pytest.mark.slow
@pytest.mark.parametrize("spec", TARGETS)
def test_linear_as_shipped(spec):
    """The trunk's projection against a bf16 W: the prefill form (row count dynamic: on the CPU
    levels v3 and v4 the mmt4d on the level's tiles) at every T, and the decode form (one row)."""
    run, _, driver = compiled("linear", spec, dynamic=True)
    for T in TOKENS:
        x, w = bf16_linear_inputs(T, LINEAR_OUT, LINEAR_IN, seed=T)
        scale = (x.double().abs() @ w.double().abs().T).numpy()   # the f32 rounding's scale
        y = run(x.numpy(), as_numpy(w))
        np.testing.assert_array_less(np.abs(y - linear_reference(x, w)), 1e-6 * scale + 1e-30, err_msg=f"T = {T}")
    run, _, driver = compiled("linear", spec, dynamic=False)
    x, w = bf16_linear_inputs(1, LINEAR_OUT, LINEAR_IN, seed=1)
    scale = (x.double().abs() @ w.double().abs().T).numpy()
    np.testing.assert_array_less(np.abs(run(x.numpy(), as_numpy(w)) - linear_reference(x, w)), 1e-6 * scale + 1e-30)


# ---- the compiled k3-tiny bundle --------------------------------------------------------------


@pytest.mark.slow
def test_validate_per_layer_prints_the_layer_table(tiny_bundle, k3c_cache, tmp_path):
    """``k3c validate --per-layer``: one row per layer with its kind, errors within the tolerance
    printed in the table, and "no layer diverges"; its JSON holds the same rows."""
    r = k3c("validate", tiny_bundle.root, "--per-layer", "--json", tmp_path / "v.json", cache_dir=k3c_cache)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no layer diverges" in r.stdout and r.stdout.rstrip().endswith("PASS")
    report = json.loads((tmp_path / "v.json").read_text())
    kinds = K3Config.preset("k3-tiny").layer_kinds
    assert [(lr["layer"], lr["kind"]) for lr in report["layers"]] == list(enumerate(kinds))
    assert all(0 < lr["max_abs"] <= report["tolerance"] for lr in report["layers"])
    table = r.stdout.split("residual stream after each layer")[1]
    rows = [[cell.strip() for cell in line.strip("│").split("│")] for line in table.splitlines() if line.startswith("│")]
    assert rows == [[str(lr["layer"]), lr["kind"], f"{lr['max_abs']:.2e}", f"{lr['max_rel']:.2e}"]
                    for lr in report["layers"]]


@pytest.mark.slow
def test_per_layer_names_the_layer_a_fault_starts_in(tiny_bundle):
    """The compiled residual streams with layer 3 onwards shifted by 1e-3: layer 3 is the first
    divergent one, at an error of 1e-3 within rounding."""
    from k3c.runtimes.session import Session
    from k3c.interface.validate import TOLERANCE as VALIDATE_TOLERANCE
    from k3c.interface.validate import first_divergent, layer_errors

    prompt = np.load(tiny_bundle.reference_path)["prompt_ids"]
    _, hidden = Session(tiny_bundle).prefill(prompt, hidden=True)
    assert first_divergent(layer_errors(tiny_bundle, prompt, hidden), VALIDATE_TOLERANCE["llvm-cpu"]) is None
    hidden[3:] += 1e-3
    bad = first_divergent(layer_errors(tiny_bundle, prompt, hidden), VALIDATE_TOLERANCE["llvm-cpu"])
    assert bad.layer == 3 and abs(bad.max_abs - 1e-3) < 1e-4


@pytest.mark.slow
def test_64_decode_steps_match_eager(tiny_bundle):
    """A 100-token prompt, then 64 decode steps fed the eager greedy tokens (the MLA caches grow
    to 164 rows, the KDA states carry 164 tokens): every logit within 1e-4, the same argmax."""
    from k3c.model.checkpoint import load_checkpoint
    from k3c.runtimes.session import Session

    model = load_checkpoint(tiny_bundle.checkpoint_dir, dtype=torch.float32)
    prompt = torch.randint(0, model.cfg.vocab_size, (100,), generator=torch.Generator().manual_seed(64))
    session = Session(tiny_bundle)
    logits, _ = session.prefill(prompt.numpy())
    with torch.no_grad():
        ref, state = model.prefill(prompt[None])
    np.testing.assert_allclose(logits, ref[0].numpy(), rtol=0, atol=1e-4)
    for step in range(64):
        token = int(ref[0, -1].argmax())
        got = session.decode(token)
        with torch.no_grad():
            ref, state = model.decode(torch.tensor([[token]]), state)
        np.testing.assert_allclose(got, ref[0, -1].numpy(), rtol=0, atol=1e-4, err_msg=f"decode step {step}")
        assert got.argmax() == ref[0, -1].argmax(), f"decode step {step}"


# ---- quiet output -----------------------------------------------------------------------------


def test_inspect_prints_no_warning():
    r = k3c("inspect", "--preset", "k3-tiny")
    assert r.returncode == 0 and "parameters" in r.stdout.lower(), r.stderr
    assert warning_lines(r.stderr) == []


def test_decompositions_print_no_warning():
    """Both places k3c runs torch's decompositions (exporter.export.decompose, and torch-mlir's
    export_and_import under ops/trace.py), on a two-op program, in a fresh interpreter."""
    code = """
import torch
from torch.export import export
from torch_mlir.extras.fx_decomp_util import get_decomposition_table
from k3c.exporter.export import decompose
from k3c.ops.base import TensorType
from k3c.ops.trace import trace_to_linalg

class Net(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.silu(x).sum(-1)

decompose(export(Net(), (torch.ones(2, 3),)), get_decomposition_table())
assert "linalg" in trace_to_linalg(Net(), [TensorType(("N", 3), torch.float32)], "f")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert warning_lines(r.stderr) == []


@pytest.mark.slow
@pytest.mark.parametrize("how, written", [(("--emit-mlir",), "lowered.mlir"), (("--format", "onnx", "-o"), "decode.onnx")])
def test_export_prints_no_warning(how, written, tmp_path):
    r = k3c("export", "--preset", "k3-tiny", *how, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / written).is_file()
    assert warning_lines(r.stderr) == []

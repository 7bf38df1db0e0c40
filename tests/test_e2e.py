"""k3-tiny end to end on the CPU: export with the k3 custom ops, their lowerings in passes/,
iree-compile, the IREE runtime and the CLI, against the eager PyTorch model on the bundle's own
checkpoint (DESIGN.md, "One way through")."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from conftest import eager_greedy  # tests/ is on sys.path
from k3c.model import K3Config
from k3c.model.checkpoint import load_checkpoint
from k3c.runtimes.session import Session

K3C = Path(sys.executable).with_name("k3c")  # the console script installed beside this interpreter
TOL = 1e-4                                    # fp32 max abs logit error
DECODE_STEPS = 8

pytestmark = pytest.mark.slow  # the compiled k3-tiny (tiny_bundle) and a whole-model export


def k3c(*args, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(K3C), *map(str, args)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "K3C_CACHE": str(cache)})


def test_compiled_logits_match_eager(tiny_bundle):
    """A 100-token prompt (a full and a padded KDA chunk, MLA caches of 100+) and 8 decode steps fed
    the eager greedy tokens: every logit within 1e-4 of the eager model's, the same argmax."""
    model = load_checkpoint(tiny_bundle.checkpoint_dir, dtype=torch.float32)
    prompt = torch.randint(0, model.cfg.vocab_size, (100,), generator=torch.Generator().manual_seed(5))
    session = Session(tiny_bundle)
    logits, _ = session.prefill(prompt.numpy())
    with torch.no_grad():
        ref, state = model.prefill(prompt[None])
    np.testing.assert_allclose(logits, ref[0].numpy(), rtol=0, atol=TOL)
    for step in range(DECODE_STEPS):
        token = int(ref[0, -1].argmax())
        got = session.decode(token)
        with torch.no_grad():
            ref, state = model.decode(torch.tensor([[token]]), state)
        np.testing.assert_allclose(got, ref[0, -1].numpy(), rtol=0, atol=TOL, err_msg=f"decode step {step}")
        assert got.argmax() == ref[0, -1].argmax()


def test_extend_pieces_of_every_length_match_eager(tiny_bundle):
    """One session, prompts of 10 tokens each continued by a piece of 51 to 70 tokens through the
    extend entry point (a prompt's later pieces, a chat turn): each piece's logits within 1e-4 of
    the eager model's prefill of the whole, whatever the session ran before."""
    model = load_checkpoint(tiny_bundle.checkpoint_dir, dtype=torch.float32)
    session = Session(tiny_bundle)
    gen = torch.Generator().manual_seed(7)
    for T in (51, 56, 60, 63, 64, 65, 66, 70, 300, 76):
        head, piece = (torch.randint(3, 500, (n,), generator=gen) for n in (10, T))
        session.prefill(head.numpy(), last_only=True)
        got = session.extend(piece.numpy())
        with torch.no_grad():
            ref = model.prefill(torch.cat([head, piece])[None])[0][0, 10:].numpy()
        np.testing.assert_allclose(got, ref, rtol=0, atol=TOL, err_msg=f"extend by {T}")


def test_validate_cli_passes(tiny_bundle, k3c_cache, tmp_path):
    r = k3c("validate", tiny_bundle.root, "--json", tmp_path / "v.json", cache=k3c_cache)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if re.match(r"\W+(prefill|decode \d+) ", line)]
    assert len(rows) == 1 + DECODE_STEPS and all(row.rstrip(" │").endswith("PASS") for row in rows), r.stdout
    assert r.stdout.strip().splitlines()[-1] == "PASS"
    steps = json.loads((tmp_path / "v.json").read_text())["steps"]
    assert [s["step"] for s in steps] == ["prefill"] + [f"decode {i}" for i in range(DECODE_STEPS)]
    assert max(s["max_abs"] for s in steps) <= TOL


def test_run_cli_matches_eager_greedy(tiny_bundle, k3c_cache):
    prompt = [7, 300, 12, 12, 501, 0, 44]
    r = k3c("run", tiny_bundle.root, "--prompt-ids", ",".join(map(str, prompt)), "-n", DECODE_STEPS, cache=k3c_cache)
    assert r.returncode == 0, r.stderr
    model = load_checkpoint(tiny_bundle.checkpoint_dir, dtype=torch.float32)
    assert [int(x) for x in r.stdout.split(",")] == eager_greedy(model, prompt, DECODE_STEPS)


def test_one_module_serves_two_checkpoints(tiny_bundle, k3c_cache, tmp_path):
    """A seed-1 checkpoint of the same config compiles from the cache to the very same module,
    which validates on it: the weights are read at run time, never folded into the module."""
    checkpoint = tmp_path / "seed1"
    assert k3c("init-checkpoint", "--preset", "k3-tiny", "--seed", 1, checkpoint, cache=k3c_cache).returncode == 0
    r = k3c("compile", "--checkpoint", checkpoint, "--max-prompt", tiny_bundle.manifest.max_prompt,
            "-o", tmp_path / "seed1-cpu", cache=k3c_cache)
    assert r.returncode == 0, r.stderr
    assert "compiled module found in cache" in r.stderr
    assert (tmp_path / "seed1-cpu" / "module.vmfb").read_bytes() == tiny_bundle.module_path.read_bytes()
    v = k3c("validate", tmp_path / "seed1-cpu", cache=k3c_cache)
    assert v.returncode == 0 and v.stdout.strip().splitlines()[-1] == "PASS", v.stdout + v.stderr
    ref0, ref1 = np.load(tiny_bundle.reference_path), np.load(tmp_path / "seed1-cpu" / "reference.npz")
    np.testing.assert_array_equal(ref0["prompt_ids"], ref1["prompt_ids"])
    assert np.abs(ref0["prefill_logits"] - ref1["prefill_logits"]).max() > 1000 * TOL


def test_running_a_bundle_loads_no_torch(tiny_bundle, k3c_cache):
    """Opening a bundle with an archive, loading it and a first prefill need iree-base-runtime
    alone: importing torch would add about 3 s to every start (docs/bundle.md §4)."""
    code = ("import sys; import numpy as np; from k3c.artifacts.bundle import open_bundle; "
            "from k3c.runtimes.session import Session; "
            f"s = Session(open_bundle({str(tiny_bundle.root)!r})); s.prefill(np.array([1, 2, 3])); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "K3C_CACHE": str(k3c_cache)})
    assert out.returncode == 0 and out.stdout.split() == ["False"], out.stderr


def test_weights_are_named_parameters(tiny_bundle):
    """Every parameter of the packed archive is named in the module (a parameter key), the archive
    holds exactly the program's parameters (docs/pipeline.md §5: one per tensor kind and layer
    group), and no 64-byte run of any sizeable checkpoint tensor, as stored or widened to fp32, is
    in the module (no weight became a constant)."""
    import iree.runtime as rt

    from k3c.artifacts.archive import META
    from k3c.model.stacking import program_dtypes
    vmfb = tiny_bundle.module_path.read_bytes()
    index = rt.ParameterIndex()
    index.load(str(tiny_bundle.root / "weights.irpa"))
    keys = {key for key, _ in index.items()} - {META}     # the archive's own description (docs/bundle.md §5)
    with safe_open(str(tiny_bundle.checkpoint_dir / "model.safetensors"), "pt") as f:
        stored = {name: f.get_slice(name).get_dtype() for name in f.keys()}
        cfg = K3Config.from_hf(tiny_bundle.checkpoint_dir)
        assert keys == set(program_dtypes(cfg, dict.fromkeys(stored, torch.float32)))
        assert {key for key in keys if key.encode() not in vmfb} == set()
        for name in f.keys():
            t = f.get_tensor(name).flatten()
            if t.numel() * t.element_size() < 4096:
                continue
            middle = t[t.numel() // 2:]
            runs = [middle.view(torch.uint8)[:64]]
            if t.is_floating_point():
                runs.append(middle[:16].float().view(torch.uint8))
            for run in runs:
                assert run.numpy().tobytes() not in vmfb, name


def module_outline(text: str) -> tuple[dict[str, list], list[tuple[str, str, bool]]]:
    """Of a printed MLIR module: each func.func's input types (text), and every func.call as (caller,
    callee, whether it sits inside an scf.for)."""
    from iree.compiler import ir

    inputs, calls = {}, []

    def visit(op):
        if op.name == "func.func":
            ftype = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
            inputs[ir.StringAttr(op.attributes["sym_name"]).value] = [str(t) for t in ftype.inputs]
        elif op.name == "func.call":
            parent, in_loop = op.parent, False
            while parent.name != "func.func":
                in_loop |= parent.name == "scf.for"
                parent = parent.parent
            calls.append((ir.StringAttr(parent.attributes["sym_name"]).value,
                          ir.FlatSymbolRefAttr(op.attributes["callee"]).value, in_loop))
        return ir.WalkResult.ADVANCE

    with ir.Context():
        ir.Module.parse(text).operation.walk(visit)
    return inputs, calls


def function_text(text: str, name: str) -> str:
    """The text of ``func.func @name`` in a printed module (up to the next function)."""
    start = text.index(f"func.func private @{name}(")
    end = text.find("func.func", start + 1)
    return text[start:end if end >= 0 else len(text)]


def barred_positions(text: str) -> tuple[int, int]:
    """Of a lowered module: how many calls of a layer body in the public functions (the entry points)
    take both positions (``at`` and the index j) through util.optimization_barrier, and how many do
    not (passes/layer_calls.py)."""
    from iree.compiler import ir

    counts = [0, 0]

    def visit(op):
        function = op.parent
        while function is not None and function.name != "func.func":
            function = function.parent
        if (op.name == "func.call" and ir.FlatSymbolRefAttr(op.attributes["callee"]).value.startswith("call_body_")
                and "sym_visibility" not in function.attributes):
            barred = all(hasattr(v.owner, "operation") and v.owner.operation.name == "util.optimization_barrier"
                         for v in list(op.operands)[1:3])
            counts[not barred] += 1
        return ir.WalkResult.ADVANCE

    with ir.Context():
        ir.Module.parse(text).operation.walk(visit)
    return tuple(counts)


def hoisted_sizes(lowered: Path) -> list[int]:
    """Elements of each global that iree-compile's global optimization hoists out of ``lowered``
    (constant expressions it computes at load time), for this host's CPU."""
    from iree.compiler.tools.core import find_tool
    from k3c.compiler.targets import parse_target
    out = lowered.with_suffix(".global-opt.mlir")
    subprocess.run([find_tool("iree-compile"), str(lowered), "--iree-input-type=torch", *parse_target("cpu").flags,
                    "--compile-to=global-optimization", "-o", str(out)], check=True)
    sizes = []
    for line in out.read_text().splitlines():
        if "util.global private @__hoisted" in line:
            dims = re.fullmatch(r"tensor<((?:\d+x)*)\w+>", line.rsplit(" : ", 1)[1].strip())
            sizes.append(int(np.prod([int(d) for d in dims[1].split("x") if d])) if dims else 1)
    return sizes


def test_emit_mlir_custom_ops_then_their_implementations(k3c_cache, tmp_path):
    """torch.mlir holds the k3 operators; lowered.mlir holds none, but calls to their implementations.
    Each layer group's body is written once per form (prefill, extend, decode); the layers outside a
    repeating run call it one by one, the run (model/stacking.py ``layer_runs``) is one marked scf.for
    per entry point whose iterations call the bodies inlined (passes/layer_calls.py). The KDA chunk
    implementation takes any T and calls the 64-token chunk function once, inside an scf.for: prefill
    up to 128 tokens (two chunks) is a run-time loop."""
    from k3c.model.stacking import layer_groups, layer_runs
    cfg = K3Config.preset("k3-tiny")
    groups = layer_groups(cfg).values()
    n_kda = sum(g.attention == "kda" for g in groups)
    n_moe = sum(g.moe for g in groups)
    r = k3c("export", "--preset", "k3-tiny", "--max-prompt", 128, "--emit-mlir", tmp_path, cache=k3c_cache)
    assert r.returncode == 0, r.stderr
    before, after = (tmp_path / "torch.mlir").read_text(), (tmp_path / "lowered.mlir").read_text()
    # per KDA group: prefill and extend bodies chunk, decode steps; per MoE group: start/prefill, extend,
    # decode (each group's public layer entry point calls its prefill/start body: no second copy)
    for op, count in (("kda_chunk", 2 * n_kda), ("kda_step", n_kda), ("mxfp4_moe", 3 * n_moe)):
        assert before.count(f'torch.operator "torch.k3.{op}"') == count, op
    assert "torch.k3." not in after

    inputs, calls = module_outline(after)
    called = lambda caller, prefix: [c for f, c, _ in calls if f == caller and c.startswith(prefix)]  # noqa: E731
    runs = layer_runs(cfg)
    single, looped = [r for r in runs if r.count == 1], [r for r in runs if r.count > 1]
    assert len(single) == 2 and [(r.period, r.count) for r in looped] == [(2, 2)]  # k3-tiny: 0, 1, 2 x [2-3]
    for entry in ("prefill", "extend", "decode"):  # one body call per layer outside the run, none in a loop
        assert len(called(entry, "call_body_")) == len(single), entry
        assert not [c for f, c, loop in calls if f == entry and loop], entry
    assert after.count("k3c.layer_loop") == 3 * len(looped)  # one marked loop per entry point
    assert len(called("call_body_kda_moe_prefill", "body_kda_moe_prefill")) == 1
    for g in groups:   # validate --layers' entry point: one call of the group's prompt-form body
        form = "prefill" if g.attention == "kda" else "start"
        assert called(f"layer_{g.name}", "") == [f"body_{g.name}_{form}"], g.name
    assert barred_positions(after) == (3 * len(single), 0)   # every written-out layer's positions, none constant
    hoisted = hoisted_sizes(tmp_path / "lowered.mlir")          # no layer's weights copied at load time
    assert hoisted and max(hoisted) < cfg.hidden_size, hoisted
    assert len(called("body_kda_moe_prefill", "k3_kda_chunk_")) == 1
    assert len(called("body_kda_moe_decode", "k3_kda_step_")) == 1
    # every projection of a decode step reads its bf16 weight through the streamed matvec (ops/linear.py),
    # the prompt's are matmuls, and so is none of the rest
    for g in groups:
        prompt = "prefill" if g.attention == "kda" else "start"
        decode, prefill = (set(called(f"body_{g.name}_{form}", "k3_linear_")) for form in ("decode", prompt))
        assert decode and all("flow.tensor.bitcast" in function_text(after, f) for f in decode), g.name
        assert prefill and not any("flow.tensor.bitcast" in function_text(after, f) for f in prefill), g.name
    assert ["flow.tensor.bitcast" in function_text(after, f) for f in set(called("decode", "k3_linear_"))] == [True]

    (impl,) = set(called("body_kda_moe_prefill", "k3_kda_chunk_"))
    H, K = cfg.kda_heads, cfg.kda_head_dim
    assert inputs[impl][0] == f"tensor<1x?x{H}x{K}xf32>"             # q [B, T, H, K], any T
    assert inputs[impl + "_chunk"][0] == f"tensor<1x256x{H}x{K}xf32>"  # one 256-token block (the cpu variant)
    assert [(f, loop) for f, c, loop in calls if c == impl + "_chunk"] == [(impl, True)]

"""Targets (compiler/targets.py, compiler/devices.py): what --target accepts, the k3 custom ops'
lowerings compiled for CUDA, ROCm and Vulkan, and run on a Vulkan device (Mesa's llvmpipe) against
fla's naive KDA and an MXFP4 dequantisation by ml_dtypes.

The op module is exported and imported the way exporter/export.py does it (torch.export, the
torch-mlir decompositions, IREE's FxImporter), then lowered by passes.Pipeline.
"""
from __future__ import annotations

from functools import cache

import iree.runtime as rt
import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from iree.compiler import ir
from iree.compiler.extras.fx_importer import FxImporter
from torch.export import Dim, export
from torch_mlir.extras.fx_decomp_util import get_decomposition_table

from k3c.errors import K3Error
from k3c.exporter.export import decompose
from k3c.ops import mxfp4
from k3c.ops.kda import kda_step_v_major, recurrent_v_major
from k3c.passes.pipeline import Pipeline, Rewrite
from conftest import needs_vulkan_run  # tests/ is on sys.path
from k3c.compiler import devices as device
from k3c.runtimes import readback
from k3c.runtimes.readback import DeviceFunction
from k3c.compiler.targets import KNOWN_TARGETS, PROBE, Target, compile_mlir, compiles_here, parse_target

LLVMPIPE = "llvmpipe (LLVM 15.0.6, 256 bits) (llvmpipe Mesa 22.3.6 (LLVM 15.0.6))"
no_vulkan = needs_vulkan_run

# ---- --target ------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, name, flag", [
    ("cpu", "cpu", "--iree-llvmcpu-target-cpu=host"),
    ("cpu:x86-64", "cpu:x86-64", "--iree-llvmcpu-target-cpu=x86-64"),
    ("cpu:x86-64-v3", "cpu:x86-64-v3", "--iree-llvmcpu-target-cpu=x86-64-v3"),
    ("cpu:x86-64-v4", "cpu:x86-64-v4", "--iree-llvmcpu-target-cpu=x86-64-v4"),
    ("cuda", "cuda:sm_80", "--iree-cuda-target=sm_80"),
    ("cuda:sm_89", "cuda:sm_89", "--iree-cuda-target=sm_89"),
    ("rocm", "rocm:gfx942", "--iree-rocm-target=gfx942"),
    ("rocm:gfx1100", "rocm:gfx1100", "--iree-rocm-target=gfx1100"),
    ("vulkan:rdna3", "vulkan:rdna3", "--iree-vulkan-target=rdna3"),
])
def test_parse_target(spec, name, flag):
    t = parse_target(spec)
    assert (t.name, t.flags[-1], t.note) == (name, flag, "")


def test_cpu_levels_name_the_features_their_code_needs():
    """x86-64-v3 is AVX2 + FMA + F16C (+ BMI, MOVBE, LZCNT), v4 adds AVX-512 F/BW/CD/DQ/VL, the
    baseline needs nothing; the level decides which lowerings an op takes."""
    base, v3, v4 = (parse_target(f"cpu:{lv}") for lv in ("x86-64", "x86-64-v3", "x86-64-v4"))
    assert base.cpu_features == () and {"avx2", "fma", "f16c"} <= set(v3.cpu_features)
    assert set(v4.cpu_features) == set(v3.cpu_features) | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    assert [t.lowering_keys for t in (base, v3)] == [("cpu:x86-64", "cpu:x86-64", "llvm-cpu"),
                                                    ("cpu:x86-64-v3", "cpu:x86-64-v3", "llvm-cpu")]


def test_host_cpu_target_takes_the_highest_level_it_reaches(monkeypatch):
    """``cpu`` records every instruction-set feature of this CPU (what iree-compile's ``host`` may
    use) and takes the lowerings of the highest level those features hold."""
    from k3c.compiler import cpu

    for flags, level in ((cpu.V3, "x86-64-v3"), (cpu.V3 + cpu.V4 + ("avx512_vnni",), "x86-64-v4"),
                         (("sse4_2", "avx"), "x86-64")):
        monkeypatch.setattr(cpu, "host_features", lambda flags=flags: frozenset(flags))
        monkeypatch.setattr(cpu, "is_x86_host", lambda: True)
        t = parse_target("cpu")
        assert (t.level, t.cpu_features) == (level, tuple(sorted(flags)))


def test_a_module_of_a_level_this_cpu_lacks_is_refused_in_one_line(monkeypatch):
    from k3c.compiler import cpu

    monkeypatch.setattr(cpu, "host_features", lambda: frozenset(cpu.V3))
    device.check_device(parse_target("cpu:x86-64-v3"))
    with pytest.raises(K3Error, match="needs CPU features this CPU lacks: avx512f, avx512bw, avx512cd, avx512dq, "
                                      "avx512vl") as e:
        device.check_device(parse_target("cpu:x86-64-v4"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("level", ["x86-64-v3", "x86-64-v4"])
def test_every_level_compiles_on_any_machine(level):
    """iree-compile builds a level's code whatever CPU compiles it (the native kernel too: it is
    built for the level, not for this host)."""
    from k3c.ops import native

    assert compiles_here(parse_target(f"cpu:{level}"))
    assert native.object_file("mxfp4_rows", level) is not None
    assert native.object_file("mxfp4_rows", "x86-64") is None   # below AVX2 the linalg kernel runs


def test_sm_90_compiles_for_sm_80_with_a_note():
    t = parse_target("cuda:sm_90")
    assert t.name == "cuda:sm_80" and "--iree-cuda-target=sm_80" in t.flags
    assert "sm_90" in t.note


def test_every_known_target_is_its_own_canonical_name():
    assert [parse_target(spec).name for spec in KNOWN_TARGETS] == list(KNOWN_TARGETS)


@pytest.mark.parametrize("spec, message", [
    ("tpu", "unknown target 'tpu'"),
    ("cuda:sm_70", "unsupported CUDA arch 'sm_70'"),
    ("rocm:gfx9999", "unsupported ROCm chip 'gfx9999'"),
    ("vulkan:foo", "unknown Vulkan profile 'foo'"),
    ("cpu:arm", "unknown CPU level 'arm'"),
])
def test_unknown_targets_are_refused(spec, message):
    with pytest.raises(K3Error, match=message):
        parse_target(spec)


@pytest.mark.parametrize("name, profile", [(LLVMPIPE, "llvmpipe"), ("AMD Radeon RX 7900 XTX (RADV NAVI31)", "rdna3"),
                                           ("NVIDIA GeForce RTX 3090", "ampere"), ("Mali-G715", "valhall")])
def test_vulkan_without_profile_takes_the_device_profile(monkeypatch, name, profile):
    monkeypatch.setattr(device, "devices", lambda driver: (name,) if driver == "vulkan" else ())
    assert parse_target("vulkan").name == f"vulkan:{profile}"


@pytest.mark.parametrize("found, message", [((), "there is none"), (("Intel(R) UHD Graphics 770",), "no known Vulkan profile")])
def test_vulkan_without_profile_needs_a_known_device(monkeypatch, found, message):
    monkeypatch.setattr(device, "devices", lambda driver: found)
    with pytest.raises(K3Error, match=message):
        parse_target("vulkan")


@no_vulkan
def test_vulkan_detected_here_is_the_device_present():
    assert parse_target("vulkan").name == f"vulkan:{device.vulkan_profile(device.devices('vulkan')[0])}"


# ---- device checks -------------------------------------------------------------------------


def test_bundle_for_another_vulkan_profile_is_refused(monkeypatch):
    monkeypatch.setattr(device, "devices", lambda driver: (LLVMPIPE,) if driver == "vulkan" else ())
    device.check_device(parse_target("vulkan:llvmpipe"))
    with pytest.raises(K3Error, match=r"compiled for vulkan:rdna3 but the Vulkan device here is 'llvmpipe .*"
                                      r"\(profile llvmpipe\); recompile"):
        device.check_device(parse_target("vulkan:rdna3"))
    with pytest.raises(K3Error, match="no cuda device here to run a cuda:sm_80 bundle"):
        device.check_device(parse_target("cuda"))


def test_vulkan_bundle_must_match_the_first_device_the_one_a_session_opens(monkeypatch):
    monkeypatch.setattr(device, "devices", lambda driver: ("NVIDIA H200", LLVMPIPE))
    device.check_device(parse_target("vulkan:ampere"))
    with pytest.raises(K3Error, match="compiled for vulkan:llvmpipe but the Vulkan device here is 'NVIDIA H200'"):
        device.check_device(parse_target("vulkan:llvmpipe"))


@no_vulkan
def test_real_vulkan_device_refuses_other_profiles():
    here = parse_target("vulkan")
    device.check_device(here)
    other = next(spec for spec in KNOWN_TARGETS if spec.startswith("vulkan:") and spec != here.name)
    with pytest.raises(K3Error, match=f"compiled for {other}"):
        device.check_device(parse_target(other))


def test_probe_compile_tells_a_working_target_from_a_broken_one():
    assert compiles_here(parse_target("cpu"))
    broken = Target("vulkan:foo", "vulkan-spirv", "vulkan", ("--iree-hal-target-device=vulkan", "--iree-vulkan-target=foo"))
    assert not compiles_here(broken)


# ---- read_back -----------------------------------------------------------------------------


def load(vmfb: bytes, driver: str):
    """Function name -> the module's function of that name on ``driver``'s device."""
    config = rt.Config(driver)
    context = readback.load(config, rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    return lambda name: DeviceFunction(context, "module", name)


def read_back(f: DeviceFunction, view) -> np.ndarray:
    return readback.read_back(f.device, view)


@pytest.mark.parametrize("spec", ["cpu", pytest.param("vulkan", marks=no_vulkan)])
def test_read_back_returns_the_device_result(spec):
    """PROBE sums the rows of a 4x8 matrix: for arange(32), row r sums to 64r + 28."""
    target = parse_target(spec)
    probe = load(compile_mlir(PROBE, target, log=lambda _: None), target.driver)("probe")
    (result,) = probe(np.arange(32, dtype=np.float32).reshape(4, 8))
    got = read_back(probe, result)
    assert got.dtype == np.float32 and got.tolist() == [28.0, 92.0, 156.0, 220.0]
    # through the device's staging copy too, the path of results that are not host visible
    assert readback.staged_copy(probe.device, result).tolist() == got.tolist()


# ---- the custom ops compiled per target ------------------------------------------------------

B, H, K, V = 1, 2, 16, 8           # KDA
E, L, I, TOP = 4, 32, 32, 2        # MXFP4 experts: in dims are multiples of the 32-wide group


class Ops(torch.nn.Module):
    """One KDA op then the MXFP4 MoE op: kda_chunk (prefill) or kda_step (decode)."""

    def __init__(self, kda_op):
        super().__init__()
        self.kda_op = kda_op

    def forward(self, q, k, v, g, beta, S, z, idx, w, w1p, w1s, w3p, w3s, w2p, w2s):
        o, S = self.kda_op(q, k, v, g, beta, S)
        return o, S, torch.ops.k3.mxfp4_moe(z, idx, w, w1p, w1s, w3p, w3s, w2p, w2s, "silu", 1.0, 1.0)


def op_inputs(T: int, seed: int) -> list[torch.Tensor]:
    """Unit q (scaled) and k, gates in (-1, 0), beta in (0, 1), a nonzero state; T tokens to the MoE."""
    gen = torch.Generator().manual_seed(seed)
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    q = unit(torch.randn(B, T, H, K, generator=gen)) * K ** -0.5
    k = unit(torch.randn(B, T, H, K, generator=gen))
    kda_in = [q, k, torch.randn(B, T, H, V, generator=gen), -torch.rand(B, T, H, K, generator=gen),
              torch.rand(B, T, H, generator=gen), torch.randn(B, H, K, V, generator=gen) * 0.5]
    experts = [t for shape in ((I, L), (I, L), (L, I)) for t in mxfp4.quantize(torch.randn(E, *shape, generator=gen) * 0.2)]
    idx = torch.stack([torch.randperm(E, generator=gen)[:TOP] for _ in range(T)])
    return kda_in + [torch.randn(T, L, generator=gen), idx, torch.rand(T, TOP, generator=gen)] + experts


@cache
def exported_ops() -> tuple:
    """prefill (dynamic T: kda_chunk, then the MoE dense over all experts) and decode (one token:
    kda_step, then the MoE gathering the picked experts), decomposed as the exporter does."""
    T = Dim("T", min=1, max=256)
    per_token = {1: T}
    prefill = export(Ops(torch.ops.k3.kda_chunk), tuple(op_inputs(5, 0)),
                     dynamic_shapes=[per_token] * 5 + [None] + [{0: T}] * 3 + [None] * 6)
    decode = export(Ops(torch.ops.k3.kda_step), tuple(op_inputs(1, 0)))
    table = get_decomposition_table()
    return decompose(prefill, table), decompose(decode, table)


@cache
def lowered_ops(rewrites: tuple[tuple[str, object], ...]) -> str:
    """The op module in torch-dialect MLIR with its custom ops lowered by ``rewrites`` ((op, generator)
    pairs), once per distinct set: CUDA and ROCm share the default lowerings."""
    context = ir.Context()
    importer = FxImporter(context=context)
    with context:
        for name, program in zip(("prefill", "decode"), exported_ops()):
            importer.import_program(program, func_name=name)
    Pipeline([Rewrite(op, generator, "") for op, generator in rewrites]).run(importer.module, log=lambda _: None)
    return str(importer.module)


@cache
def compiled_ops(spec: str) -> bytes:
    target = parse_target(spec)
    rewrites = tuple((r.op, r.generator) for r in Pipeline.for_target(target).rewrites)
    return compile_mlir(lowered_ops(rewrites), target, log=lambda _: None)


@pytest.mark.slow  # three op modules compiled for devices this host may not have
@pytest.mark.parametrize("spec, executable_format", [
    ("cuda:sm_80", b"cuda-nvptx-fb"), ("rocm:gfx942", b"rocm-hsaco-fb"), ("vulkan:llvmpipe", b"vulkan-spirv-fb"),
])
def test_custom_ops_compile_for(spec, executable_format):
    assert executable_format in compiled_ops(spec)


def test_v_major_step_matches_fla(fla_naive):
    """The SPIR-V variant of kda_step, eager, against fla's naive recurrent KDA over 3 tokens."""
    q, k, v, g, beta, S0 = op_inputs(3, 2)[:6]
    o, S = recurrent_v_major(q, k, v, g, beta, S0)
    o_ref, S_ref = fla_naive.naive_recurrent_kda(q, k, v, g, beta, scale=1.0, initial_state=S0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(S, S_ref, rtol=0, atol=1e-5)


def test_vulkan_pipeline_swaps_in_the_v_major_step():
    ops = {r.op: r.generator for r in Pipeline.for_target(parse_target("vulkan:llvmpipe")).rewrites}
    assert ops["torch.k3.kda_step"] is kda_step_v_major
    assert Pipeline.for_target(parse_target("cuda")).rewrites == Pipeline().rewrites


def dequantize(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """MXFP4 by ml_dtypes: nibbles as float4_e2m1fn (low first), scales as float8_e8m0fnu, groups of 32."""
    nibbles = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    values = nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    scales = scale.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    return (values.reshape(*scale.shape, 32) * scales[..., None]).reshape(values.shape)


def moe_reference(z, idx, w, w1p, w1s, w3p, w3s, w2p, w2s) -> np.ndarray:
    """y_n = sum over the picked experts e of w_ne W2_e (silu(W1_e z_n) * W3_e z_n), token by token."""
    W1, W3, W2 = (dequantize(p.numpy(), s.numpy()) for p, s in ((w1p, w1s), (w3p, w3s), (w2p, w2s)))
    y = np.zeros((z.shape[0], L), np.float64)
    for n, (experts, weights) in enumerate(zip(idx.tolist(), w.tolist())):
        for e, weight in zip(experts, weights):
            gate, up = W1[e] @ z[n].numpy(), W3[e] @ z[n].numpy()
            y[n] += weight * W2[e] @ (F.silu(torch.from_numpy(gate)).numpy() * up)
    return y


@pytest.mark.slow  # compiles the op module for Vulkan
@no_vulkan
def test_custom_ops_on_vulkan_match_independent_references(fla_naive):
    """prefill of 70 tokens (a full chunk and a padded tail), then 3 decode steps fed the state
    the device returned (it never comes to the host), all within 1e-4 of fla's naive recurrent
    KDA and the ml_dtypes MoE."""
    target = parse_target("vulkan")
    ops = load(compiled_ops(target.name), target.driver)
    prefill, decode = ops("prefill"), ops("decode")
    inputs = op_inputs(70, 1)
    o, S, y = prefill(*(t.numpy() for t in inputs))
    q, k, v, g, beta, S0 = inputs[:6]
    o_ref, S_ref = fla_naive.naive_recurrent_kda(q, k, v, g, beta, scale=1.0, initial_state=S0,
                                                 output_final_state=True)
    np.testing.assert_allclose(read_back(prefill, o), o_ref.numpy(), rtol=0, atol=1e-4)
    np.testing.assert_allclose(read_back(prefill, y), moe_reference(*inputs[6:]), rtol=0, atol=1e-4)
    for step in range(3):
        token = op_inputs(1, 10 + step)
        o, S, y = decode(*(t.numpy() for t in token[:5]), S, *(t.numpy() for t in token[6:]))
        o_ref, S_ref = fla_naive.naive_recurrent_kda(*token[:5], scale=1.0, initial_state=S_ref,
                                                     output_final_state=True)
        np.testing.assert_allclose(read_back(prefill, o), o_ref.numpy(), rtol=0, atol=1e-4)
        np.testing.assert_allclose(read_back(prefill, y), moe_reference(*token[6:]), rtol=0, atol=1e-4)
    np.testing.assert_allclose(read_back(prefill, S), S_ref.numpy(), rtol=0, atol=1e-4)


def routing_module(E: int, k: int, target, D: int = 64) -> str:
    """model/moe.py ``route`` over a dynamic number of tokens, exported, imported and lowered for
    ``target`` the way the model is (the router's projection is k3::linear)."""
    from k3c.model import K3Config
    from k3c.model.moe import route
    from k3c.passes.pipeline import Pipeline

    cfg = K3Config(num_experts=E, num_experts_per_token=k, hidden_size=D)

    class Router(torch.nn.Module):
        def forward(self, x, gate, bias):
            return route(cfg, x, gate, bias)

    example = (torch.randn(5, D), torch.randn(E, D), torch.randn(E))
    program = export(Router(), example, dynamic_shapes=({0: Dim("N", min=1, max=4096)}, None, None))
    context = ir.Context()
    importer = FxImporter(context=context)
    with context:
        importer.import_program(decompose(program, get_decomposition_table()), func_name="main")
    Pipeline.for_target(target).run(importer.module, log=lambda _: None)
    return str(importer.module)


@pytest.mark.slow  # compiles for a device this host may not have
def test_routing_over_k3_experts_compiles_for_cuda():
    """K3's 896 experts, top-16: IREE 3.13's CUDA backend failed to distribute an argmax this wide."""
    target = parse_target("cuda:sm_80")
    assert b"cuda-nvptx-fb" in compile_mlir(routing_module(896, 16, target), target, log=lambda _: None)

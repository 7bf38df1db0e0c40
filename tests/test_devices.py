"""One program over N devices (docs/devices.md §1): the routed experts split over the devices.

The cheap checks run the ops eagerly and the target/refusal logic; the slow ones compile k3-tiny
for 2 and 4 local CPU devices and validate it against the same PyTorch reference and tolerance as
the one-device bundle, read the placement back from iree-compile's stream IR, and compile for 8
CUDA and 8 ROCm devices.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3c.compiler import devices as host_devices
from k3c.compiler.targets import on_devices, parse_target
from k3c.errors import K3Error
from k3c.exporter.devices import device_of
from k3c.model.placement import expert_ranges
from k3c.ops import mxfp4
from k3c.ops.mxfp4_moe import mxfp4_moe

K3C = Path(sys.executable).with_name("k3c")


def test_targets_over_devices():
    one = parse_target("cpu")
    assert on_devices(one, 1) is one and "devices" not in one.to_dict()
    four = on_devices(one, 4)
    assert four.devices == 4 and four.to_dict()["devices"] == 4
    assert [f for f in four.flags if f.startswith("--iree-hal-target-device=")] == [f"--iree-hal-target-device=local[{i}]" for i in range(4)]
    cuda = on_devices(parse_target("cuda:sm_80"), 8)
    assert cuda.flags.count("--iree-cuda-target=sm_80") == 1 and "--iree-hal-target-device=cuda[7]" in cuda.flags
    with pytest.raises(K3Error, match="vulkan runs on one device"):
        on_devices(parse_target("vulkan:llvmpipe"), 2)


def test_a_bundle_for_more_devices_than_here_refuses(monkeypatch):
    monkeypatch.setattr(host_devices, "devices", lambda driver: ("GPU-0",))
    with pytest.raises(K3Error, match=r"^device: the bundle runs on 8 cuda devices and this host has 1; "):
        host_devices.check_device(on_devices(parse_target("cuda:sm_80"), 8))
    host_devices.check_device(parse_target("cuda:sm_80"))   # one device: fine


def test_expert_shards_sum_to_the_whole_layer():
    """The per-device calls of exporter/devices.py (each device's range, ids shifted by its start,
    pairs of other devices skipped) add up to the op over all experts."""
    g = torch.Generator().manual_seed(0)
    E, I, L, N, k = 8, 32, 64, 5, 2
    z, w = torch.randn(N, L, generator=g), torch.rand(N, k, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    weights = []
    for out, inp in ((I, L), (I, L), (L, I)):
        packed, scale = mxfp4.quantize(torch.randn(E, out, inp, generator=g) * 0.1)
        weights += [packed, scale]
    whole = mxfp4_moe(z, idx, w, *weights, "silu", 1.0, 1.0)
    for n in (2, 3):
        parts = sum(mxfp4_moe(z, idx - r.start, w, *(t[r.start:r.stop] for t in weights), "silu", 1.0, 1.0)
                    for r in expert_ranges(E, n))
        torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-6)


def test_device_of_parameter_names():
    assert device_of("layers.kda_moe.block_sparse_moe.experts.d3.w2.weight_scale") == 3
    assert device_of("layers.kda_moe.block_sparse_moe.experts.w2.weight_scale") == 0
    assert device_of("lm_head.weight") == 0


def _compile(args, cache, timeout=1500):
    r = subprocess.run([str(K3C), *args], capture_output=True, text=True, timeout=timeout,
                       env={**__import__("os").environ, "K3C_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.slow
@pytest.mark.parametrize("n", [2])
def test_tiny_on_local_devices_validates(n, k3c_cache, tmp_path):
    """k3c compile --devices N then k3c validate: the same reference and tolerance as one device.
    (Each count is a whole compile; the split of the experts over 3 devices is checked eagerly above.)"""
    bundle = tmp_path / f"tiny-x{n}"
    _compile(["compile", "--preset", "k3-tiny", "--target", "cpu", "--devices", str(n), "-o", str(bundle)], k3c_cache)
    r = _compile(["validate", str(bundle)], k3c_cache, timeout=600)
    assert "PASS" in r.stdout


def stream_ir(lowered: str, target) -> str:
    from iree.compiler import compile_str
    return compile_str(lowered, input_type="torch", extra_args=[*target.flags, "--compile-to=stream"]).decode()


CONSTANT = re.compile(r'(%buffer_cst\w*) = util\.buffer\.constant : !util\.buffer = "([^"]+)"')
LOAD = re.compile(r"stream\.cmd\.parameter\.load on\(#hal\.device\.affinity<@__device_(\d+)>\) \{(.*?)\n\s*\}", re.S)
EXECUTE = re.compile(r"stream\.cmd\.execute on\(#hal\.device\.affinity<@__device_(\d+)>\)[^\n]*with\(([^\n]*)")
PARAMETER_VALUE = re.compile(r"%__param_(\w+?) as ")
SHARD_SYMBOL = re.compile(r".*_experts_d(\d+)_w[123]_weight_(packed|scale)")


def placement_violations(stream: str, n: int) -> list[str]:
    """What the stream IR does against the plan (passes/devices.py), one line each: a parameter
    loaded on a device not its own, or twice; a parameter used by work (a dispatch or a copy) on
    another device than its own, which is an expert running on the wrong device or a weight copied
    across; a device with no work on its experts."""
    names = dict(CONSTANT.findall(stream))
    bad, loaded = [], {}
    for device, body in LOAD.findall(stream):
        for ref in re.findall(r"::(%buffer_cst\w*)\[", body):
            name = names[ref]
            if name in loaded:
                bad.append(f"{name} loaded twice")
            loaded[name] = int(device)
            if device_of(name) != int(device):
                bad.append(f"{name} loaded on device {device}, belongs on {device_of(name)}")
    worked = set()
    for device, operands in EXECUTE.findall(stream):
        for symbol in PARAMETER_VALUE.findall(operands):
            m = SHARD_SYMBOL.fullmatch(symbol)
            own = int(m[1]) if m else 0
            if own != int(device):
                bad.append(f"parameter {symbol} (device {own}) used by work on device {device}")
            elif m:
                worked.add(own)
    bad += [f"no work on device {d}'s experts" for d in range(n) if d not in worked]
    bad += [f"device {d} loads no parameter" for d in range(n) if d not in loaded.values()]
    return sorted(set(bad))


@pytest.mark.slow
@pytest.mark.parametrize("misplaced", [False, True], ids=["as-built", "one-weight-misplaced"])
def test_placement_in_stream_ir(misplaced, k3c_cache, tmp_path, monkeypatch):
    """Each device loads only its parameters and every use of a weight is on its device; the same
    check on the program with one device-1 weight pinned to device 0 (a deliberate misplacement)
    must report it."""
    from k3c.interface import DEFAULT_MAX_PROMPT
    from k3c.interface.build import export_mlir
    from k3c.model import K3Config
    monkeypatch.setenv("K3C_CACHE", str(k3c_cache))
    target = on_devices(parse_target("cpu"), 2)
    # the default max prompt: the export cached by the 2-device compile above serves
    export_mlir(tmp_path / "mlir", K3Config.preset("k3-tiny"), target, max_prompt=DEFAULT_MAX_PROMPT, force=False,
                log=lambda _: None)
    lowered = (tmp_path / "mlir" / "lowered.mlir").read_text()
    if misplaced:
        victim = re.search(r"(util\.global private @__param_\w+_experts_d1_w2_weight_packed \{stream\.affinity = "
                           r"#hal\.device\.promise<@__device_)1>", lowered)
        lowered = lowered.replace(victim[0], victim[1] + "0>")
    bad = placement_violations(stream_ir(lowered, target), 2)
    if misplaced:
        assert any("d1_w2_weight_packed" in b and "device 0" in b for b in bad), bad
    else:
        assert bad == []


@pytest.mark.slow
@pytest.mark.parametrize("target", ["cuda:sm_80"])
def test_compiles_for_eight_gpus(target, k3c_cache, tmp_path):
    """k3c compile --no-weights --devices 8 for CUDA (compile only: CI has no GPU); ROCm's code
    generation is compiled for one device in test_e2e_targets.py, the multi-device program is the
    same for every GPU driver (compiler/targets.py on_devices)."""
    out = tmp_path / "module"
    _compile(["compile", "--preset", "k3-tiny", "--no-weights", "--target", target, "--devices", "8", "-o", str(out)],
             k3c_cache)
    manifest = __import__("json").loads((out / "manifest.json").read_text())
    assert manifest["target"]["devices"] == 8

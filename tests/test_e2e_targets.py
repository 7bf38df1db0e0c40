"""k3-tiny beyond this host's CPU target: the whole model validated at every CPU level this host
executes (x86-64, x86-64-v3 and, on an AVX-512 host, x86-64-v4) and on Vulkan (Mesa's llvmpipe, which
.ci/run installs), and compiled for CUDA and ROCm, where this machine has no device. Each build reuses the
export of the CPU bundle (the export cache is per config, shared by every target)."""
from __future__ import annotations

import pytest

from k3c.interface.build import build_bundle
from conftest import VULKAN_RUNS, cpu_target, needs_vulkan_run  # tests/ is on sys.path
from k3c.compiler.targets import parse_target
from k3c.interface.validate import TOLERANCE, validate

pytestmark = pytest.mark.slow  # whole-model compiles for four targets


def build_for(target: str, tiny_bundle, k3c_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("K3C_CACHE", str(k3c_cache))
    logs = []
    bundle = build_bundle(tmp_path / target.replace(":", "-"), parse_target(target),
                          checkpoint=tiny_bundle.checkpoint_dir, max_prompt=tiny_bundle.manifest.max_prompt,
                          log=logs.append)
    assert any("exported module found in cache" in line for line in logs), logs
    return bundle


@pytest.mark.parametrize("target", [cpu_target(t) for t in ("cpu:x86-64", "cpu:x86-64-v3", "cpu:x86-64-v4")])
def test_k3_tiny_validates_at_each_cpu_level(target, tiny_bundle, k3c_cache, tmp_path, monkeypatch):
    bundle = build_for(target, tiny_bundle, k3c_cache, tmp_path, monkeypatch)
    assert bundle.manifest.target["name"] == target
    steps, _ = validate(bundle)
    assert len(steps) == 9
    for s in steps:
        assert s.passed and s.max_abs <= TOLERANCE["llvm-cpu"] and s.top1 == 1.0, s


@pytest.fixture(scope="module")
def vulkan_bundle(tiny_bundle, k3c_cache, tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        return build_for("vulkan", tiny_bundle, k3c_cache, tmp_path_factory.mktemp("vulkan"), monkeypatch)


@needs_vulkan_run
def test_k3_tiny_validates_on_vulkan(vulkan_bundle):
    assert vulkan_bundle.manifest.target["name"] == "vulkan:llvmpipe"
    steps, _ = validate(vulkan_bundle)
    assert len(steps) == 9
    for s in steps:
        assert s.passed and s.max_abs <= TOLERANCE["vulkan-spirv"] and s.top1 == 1.0, s


@needs_vulkan_run
def test_vulkan_limits_are_checked_before_running(vulkan_bundle, monkeypatch):
    """On llvmpipe's own limits the bundle opens with the config's whole context. On a device that
    reports a binding limit below the bundle's largest tensor, `k3c run` is one error line before
    anything runs. (A limit that bounds the context instead: test_device_limits.py; at k3-tiny's
    sizes the largest fixed tensor already holds the MLA caches of more than 4096 tokens.)"""
    from click.testing import CliRunner

    from k3c.cli import main
    from k3c.compiler.device_limits import DeviceLimits
    from k3c.runtimes import session as session_module
    from k3c.runtimes.device_fit import footprint

    s = session_module.Session(vulkan_bundle)
    assert (s.max_context, s.context_limit) == (4096, "")
    largest = max(size for _, size in footprint(vulkan_bundle.manifest).tensors)
    monkeypatch.setattr(session_module, "limits_of", lambda name: DeviceLimits("a small device", largest - 1, 2**31, 2**31))
    result = CliRunner().invoke(main, ["run", str(vulkan_bundle.root), "--prompt-ids", "1,2,3"])
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert result.output.startswith("error: device: ") and "over the maxStorageBufferRange of 'a small device'" \
        in result.output


def losing_the_device(session_module, monkeypatch, times: int) -> list:
    """``load_bundle`` failing ``times`` times as IREE's Vulkan queue race fails it (a lost device,
    DATA_LOSS from the initializer's fence), then loading for real; the devices it was given."""
    real, given = session_module.load_bundle, []

    def load_bundle(config, bundle):
        given.append(config.device)
        if len(given) <= times:
            raise RuntimeError("Error creating vm context with modules: DATA_LOSS; while invoking native "
                               "function hal.fence.await; while calling variadic import")
        return real(config, bundle)
    monkeypatch.setattr(session_module, "load_bundle", load_bundle)
    return given


@needs_vulkan_run
def test_a_device_lost_while_loading_is_loaded_again_on_a_new_device(vulkan_bundle, monkeypatch, capsys):
    """The workaround for IREE 3.13's Vulkan queue race (docs/pipeline.md §4): the parameters load
    again on a new device, with one warning line each time, and the session computes the reference
    logits there; after three lost devices the loss is one error line."""
    from k3c.errors import K3Error
    from k3c.runtimes import session as session_module

    given = losing_the_device(session_module, monkeypatch, times=1)
    steps, _ = validate(vulkan_bundle)
    assert all(s.passed for s in steps) and len(given) == 2 and given[0] is not given[1]
    assert capsys.readouterr().err.count("warning: the Vulkan device was lost while loading") == 1

    losing_the_device(session_module, monkeypatch, times=3)
    with pytest.raises(K3Error, match=r"^run: the module in .* does not load with its parameters: DATA_LOSS"):
        session_module.Session(vulkan_bundle)


def test_a_cpu_device_is_not_loaded_again(tiny_bundle, monkeypatch):
    """Only the Vulkan race is worked around: on the CPU the first failure is the error."""
    from k3c.errors import K3Error
    from k3c.runtimes import session as session_module

    given = losing_the_device(session_module, monkeypatch, times=1)
    with pytest.raises(K3Error, match="does not load with its parameters: DATA_LOSS"):
        session_module.Session(tiny_bundle)
    assert len(given) == 1


@pytest.mark.parametrize("target, magic", [("cuda:sm_80", b"cuda-nvptx-fb"), ("rocm:gfx942", b"rocm-hsaco-fb")])
def test_k3_tiny_compiles_for_gpu(target, magic, tiny_bundle, k3c_cache, tmp_path, monkeypatch):
    bundle = build_for(target, tiny_bundle, k3c_cache, tmp_path, monkeypatch)
    assert magic in bundle.module_path.read_bytes()


def test_targets_validate_markdown(tiny_bundle, k3c_cache, tmp_path, monkeypatch):
    """`k3c targets --validate k3-tiny --markdown` on three targets: the modules
    come from the compile cache, the numbers from validating each against PyTorch."""
    from click.testing import CliRunner

    from k3c.cli import main
    from k3c.compiler import targets

    monkeypatch.setattr(targets, "KNOWN_TARGETS", ("cpu", "cuda:sm_80", "vulkan:llvmpipe") if VULKAN_RUNS
                        else ("cpu", "cuda:sm_80"))
    result = CliRunner().invoke(main, ["targets", "--validate", "k3-tiny", "--markdown", "--work", str(tmp_path)],
                                env={"K3C_CACHE": str(k3c_cache)})
    assert result.exit_code == 0, (result.output, result.exception)
    rows = {line.split(" | ")[0].strip("| "): line.strip("| ").split(" | ")
            for line in result.output.splitlines() if line.startswith("| ")}
    assert rows["target"][5:] == ["k3-tiny validated", "worst max abs", "tolerance"]
    assert rows["cpu"][2:4] == ["yes", "yes"] and rows["cpu"][5] == "PASS"
    assert 0 < float(rows["cpu"][6]) <= float(rows["cpu"][7]) == TOLERANCE["llvm-cpu"]
    assert rows["cuda:sm_80"][3:] == ["no", "-", "not run: no matching device", "-", "0.0005"]
    if VULKAN_RUNS:
        assert rows["vulkan:llvmpipe"][5] == "PASS" and float(rows["vulkan:llvmpipe"][6]) <= 5e-4

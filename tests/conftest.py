"""Shared fixtures: fla-core's naive KDA references and seeded k3-tiny models."""
from __future__ import annotations

import os

import pytest
import torch
from fla_reference import load_gates, load_naive  # tests/ is on sys.path (pytest's prepend import mode)

from k3c.compiler.devices import devices
from k3c.model import K3Config, K3Model
from k3c.model.init import init_weights

# Vulkan execution runs wherever a Vulkan device is found (.ci/run installs Mesa's llvmpipe).
VULKAN_RUNS = bool(devices("vulkan"))
needs_vulkan_run = pytest.mark.skipif(not VULKAN_RUNS, reason="no Vulkan device here (Mesa's llvmpipe: apt-get "
                                      "install mesa-vulkan-drivers)")


def cpu_target(target: str, *values):
    """``pytest.param(target, *values)`` for a CPU target, skipped in one line where this CPU lacks a
    feature its code uses (compiler/cpu.py): an AVX-512 host runs every level, an AVX2 host all but
    x86-64-v4."""
    from k3c.compiler.cpu import missing
    from k3c.compiler.targets import parse_target

    lacking = missing(parse_target(target).cpu_features)
    marks = pytest.mark.skip(reason=f"{target} needs {', '.join(lacking)}, which this CPU lacks") if lacking else ()
    return pytest.param(target, *values, marks=marks, id="-".join([target, *map(str, values)]))


def pytest_collection_modifyitems(items):
    """A test that needs ``tiny_bundle`` or ``tiny_pool_bundle`` (a whole-model compile) is slow,
    marked or not: the fast tier never compiles a whole model."""
    for item in items:
        if {"tiny_bundle", "tiny_pool_bundle"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


# every CPU target the tests run: this host's and each level
CPU_TARGETS = ("cpu", "cpu:x86-64", "cpu:x86-64-v3", "cpu:x86-64-v4")

# The tests run many small ops; a second intra-op thread only adds synchronisation (several times
# slower on a shared 2-core machine).
torch.set_num_threads(1)


def eager_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy ids: the first from prefill, then n - 1 decode steps."""
    with torch.no_grad():
        logits, state = model.prefill(torch.tensor([prompt]))
        ids = [int(logits[0, -1].argmax())]
        for _ in range(n - 1):
            logits, state = model.decode(torch.tensor([[ids[-1]]]), state)
            ids.append(int(logits[0, -1].argmax()))
    return ids


@pytest.fixture(scope="session")
def fla_naive():
    """fla/ops/kda/naive.py: naive_recurrent_kda, naive_chunk_kda."""
    return load_naive()


@pytest.fixture(scope="session")
def fla_gates():
    """{'naive_kda_gate': ..., 'naive_kda_lowerbound_gate': ...} from fla/ops/kda/gate.py."""
    return load_gates()


@pytest.fixture(scope="session")
def tiny_cfg() -> K3Config:
    return K3Config.preset("k3-tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_cfg) -> K3Model:
    """k3-tiny with seeded random weights, fp32, eval mode."""
    return init_weights(K3Model(tiny_cfg), seed=0).eval()


@pytest.fixture(scope="session")
def tiny_model64(tiny_cfg) -> K3Model:
    """The same weights as ``tiny_model`` (drawn in fp32, widened exactly) in float64."""
    return init_weights(K3Model(tiny_cfg), seed=0).double().eval()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A seed-0 k3-tiny checkpoint directory as ``k3c init-checkpoint`` writes it. Read it, don't
    modify it (copy it first)."""
    from k3c.interface.checkpoints import init_checkpoint
    out = tmp_path_factory.mktemp("ck") / "k3-tiny"
    init_checkpoint("k3-tiny", 0, out, None, force=False, log=lambda _: None)
    return out


@pytest.fixture(scope="session")
def k3c_cache(tmp_path_factory):
    """An empty compile cache (K3C_CACHE) for this run, so ``tiny_bundle`` is really compiled; one
    for all the run's pytest-xdist workers (each entry is built by one of them while the others
    wait: utils/files.py ``cache_lock``), so a module is compiled once per run."""
    base = tmp_path_factory.getbasetemp()
    cache = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "k3c-cache"
    cache.mkdir(exist_ok=True)
    return cache


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory, k3c_cache):
    """ONE k3-tiny CPU bundle for the whole suite (seed-0 checkpoint inside, the default max prompt, so its
    validation prompt of 600 tokens crosses the CPU's 256-token KDA blocks in one prefill call):
    export, passes, iree-compile and reference outputs, about 2 minutes on 2 cores. Read it, don't
    modify it (copy it first)."""
    from k3c.interface.build import build_bundle
    from k3c.compiler.targets import parse_target
    with pytest.MonkeyPatch.context() as env:
        env.setenv("K3C_CACHE", str(k3c_cache))
        return build_bundle(tmp_path_factory.mktemp("bundles") / "k3-tiny-cpu", parse_target("cpu"),
                            preset="k3-tiny")


# the sequence pool of ``tiny_pool_bundle``: decode steps of 1, 2, 4 and 8 sequences, each holding
# the model's whole context
TINY_POOL = {"max_batch": 8}


@pytest.fixture(scope="session")
def tiny_pool_bundle(tmp_path_factory, k3c_cache):
    """The k3-tiny CPU bundle (seed 0) compiled for serving (``k3c compile --max-batch 8``):
    the entry points of ``tiny_bundle`` and a sequence pool. Read it, don't modify it."""
    from k3c.compiler.targets import parse_target
    from k3c.exporter.entry_points import Pool
    from k3c.interface.build import build_bundle
    pool = Pool(context=K3Config.preset("k3-tiny").max_position_embeddings, **TINY_POOL)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("K3C_CACHE", str(k3c_cache))
        return build_bundle(tmp_path_factory.mktemp("bundles") / "k3-tiny-cpu-pool", parse_target("cpu"),
                            preset="k3-tiny", pool=pool)

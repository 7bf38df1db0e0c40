"""Layer counts other than the presets': k3-tiny's widths with K3's layer plan (MLA on every 4th layer
and the last) at 2 to 13 layers, and Kimi Linear's (MLA on every 4th, plain residuals, plain MoE),
compiled for cpu:x86-64 with --no-weights; some attached to seeded checkpoints and validated against
eager PyTorch.

The compiled program depends on the count through its layer runs (model/stacking.py ``layer_runs``):
which layers are written out before the loop, the loop's iteration, whether layers follow it. Those
loop forms are few (``loop_form``: six for 2 to 13 layers), but each count is a whole compile (2 to 6
minutes on 2 shared cores), so the suite compiles and validates 8 and 9 layers (the form that failed
in iree-compile until the MoE grouping changed, docs/pipeline.md §5); ``K3C_LAYER_COUNTS=forms``
validates 5 and 13 too and compiles one count of every other form (7 among them, which failed while
the loop read its positions back from the device) and Kimi Linear's 27, ``=all`` every count from 2
to 13 and Kimi Linear's 8 and 27."""
from __future__ import annotations

import dataclasses
import os

import pytest

from test_layer_runs import deeper  # tests/ is on sys.path
from k3c.compiler.targets import parse_target
from k3c.interface.build import attach_weights, build_module_only
from k3c.interface.validate import validate
from k3c.model import K3Config, K3Model
from k3c.model.convert import save_checkpoint
from k3c.model.init import init_weights
from k3c.model.stacking import group_name, layer_runs

TARGET = "cpu:x86-64"
MAX_PROMPT = 64        # the validation prompt is min(600, max prompt) tokens: one prefill call
K3_COUNTS = range(2, 14)
VALIDATED = (5, 8, 9, 13)
KIMI_COUNTS = (8, 27)  # 27: Kimi Linear's own depth; 8: the form of K3's 8 layers
MODE = os.environ.get("K3C_LAYER_COUNTS")


def k3_plan(n: int) -> K3Config:
    return deeper(K3Config.preset("k3-tiny"), n)


def kimi_plan(n: int) -> K3Config:
    """k3-tiny's widths with Kimi Linear's plan: MLA at 1-indexed 4, 8, ... (not the last), no
    AttnRes, routed experts of the model's width."""
    cfg = K3Config.preset("k3-tiny")
    full = list(range(4, n + 1, 4))
    plan = {"full_attn_layers": full, "kda_layers": [i for i in range(1, n + 1) if i not in full]}
    return dataclasses.replace(cfg, num_hidden_layers=n, attn_res_block_size=None, routed_expert_hidden_size=None,
                               linear_attn_config={**cfg.linear_attn_config, **plan})


def loop_form(cfg: K3Config) -> tuple:
    """What of the layer plan shapes the compiled program: the groups of the layers written out
    before the loop, of the loop's iteration, and whether layers follow it ("no loop" without one)."""
    names = [group_name(cfg, i) for i in range(cfg.num_hidden_layers)]
    loops = [r for r in layer_runs(cfg) if r.count > 1]
    if not loops:
        return ("no loop",)
    run = loops[0]
    return (tuple(names[:run.start]), tuple(names[i] for i in run.layers(0)),
            run.start + run.period * run.count < cfg.num_hidden_layers)


def one_count_per_form() -> list[int]:
    """The validated counts and the first count of each other loop form of 2 to 13 layers."""
    chosen = list(VALIDATED)
    seen = {loop_form(k3_plan(n)) for n in chosen}
    for n in K3_COUNTS:
        if (form := loop_form(k3_plan(n))) not in seen:
            chosen.append(n)
            seen.add(form)
    return sorted(chosen)


def k3_counts() -> list[int]:
    """What the suite compiles (module docstring)."""
    return list(K3_COUNTS) if MODE == "all" else one_count_per_form() if MODE == "forms" else list(validated())


def validated() -> tuple[int, ...]:
    return VALIDATED if MODE in ("all", "forms") else (8, 9)


def kimi_counts() -> list:
    if MODE in ("all", "forms"):
        return list(KIMI_COUNTS if MODE == "all" else KIMI_COUNTS[1:])
    return [pytest.param(27, marks=pytest.mark.skip(reason="a whole compile: K3C_LAYER_COUNTS=forms or all runs it"))]


def test_chosen_counts_cover_every_loop_form():
    forms = {loop_form(k3_plan(n)) for n in K3_COUNTS}
    assert {loop_form(k3_plan(n)) for n in one_count_per_form()} == forms
    # the form of the 8- and 9-layer plans: layers 0-3 written out, a loop of KDA MoE layers, MLA after
    assert loop_form(k3_plan(8)) == loop_form(k3_plan(9)) == (
        ("kda_dense", "kda_moe", "kda_moe", "mla_moe"), ("kda_moe",), True)
    assert len(forms) <= 6


@pytest.fixture(scope="session")
def compiled(tmp_path_factory, k3c_cache):
    """cfg -> the directory of its module compiled with --no-weights (build_module_only), compiled
    once per session into the suite's compile cache; the validating tests reuse the compiling
    tests' modules."""
    modules: dict[str, object] = {}
    root = tmp_path_factory.mktemp("layer-counts")

    def module(cfg: K3Config):
        if cfg.hash not in modules:
            with pytest.MonkeyPatch.context() as env:
                env.setenv("K3C_CACHE", str(k3c_cache))
                out = root / f"{cfg.num_hidden_layers}-{cfg.hash[:8]}"
                modules[cfg.hash] = build_module_only(out, cfg, parse_target(TARGET), max_prompt=MAX_PROMPT,
                                                      force=False, log=lambda _: None)
        return modules[cfg.hash]
    return module


@pytest.mark.slow
@pytest.mark.parametrize("n", k3_counts())
def test_k3_plan_compiles(compiled, n):
    assert (compiled(k3_plan(n)) / "module.vmfb").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("n", kimi_counts())
def test_kimi_linear_plan_compiles(compiled, n):
    assert (compiled(kimi_plan(n)) / "module.vmfb").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("n", validated())
def test_k3_plan_validates(compiled, tmp_path, k3c_cache, monkeypatch, n):
    """The module compiled above with a seed-0 checkpoint of its config attached (k3c attach: no
    second compile): prefill and decode steps within the CPU tolerance of eager PyTorch."""
    cfg = k3_plan(n)
    module = compiled(cfg)
    checkpoint = save_checkpoint(init_weights(K3Model(cfg), seed=0), tmp_path / "checkpoint")
    monkeypatch.setenv("K3C_CACHE", str(k3c_cache))
    bundle = attach_weights(module, checkpoint, tmp_path / "bundle", log=lambda _: None)
    steps, _ = validate(bundle)
    assert all(s.passed for s in steps), [(s.step, s.max_abs) for s in steps if not s.passed]

"""``k3c bench``: the compiled IREE CPU modules against PyTorch eager, and the compiler's own costs.

Every judged figure is a ratio of measurements taken side by side in one run: the cases are run
round-robin (the order reversed every other round, after one warm-up call each), and a ratio is
the median of the per-round ratios, so load from other processes shifts both sides alike.
Absolute medians are reported too, but not judged. Sections:

    decode    time per token, compiled vs eager, at several contexts (k3-small)
    prefill   tokens/s, compiled vs eager (a prompt longer than the module's max_prompt in pieces, as k3c run does)
    layers    prefill of one KDA attention, MLA attention and MoE block, compiled vs eager
    kda       compiled chunkwise KDA prefill vs T, and vs a compiled token-by-token recurrence
    moe       decode-step MXFP4 expert FFN: weight bytes/s vs a large memory copy; vs bf16 experts
    hybrid    decode time of k3-small vs the same model with every attention layer MLA
    compile   iree-compile wall and CPU time and peak memory at several depths, and of the full K3
    serve     k3c serve under 1, 2, 4, 8 concurrent streams vs k3c run (interface/bench_serve.py)
    peer      k3c against llama.cpp on one Kimi Linear checkpoint (interface/bench_peer.py); only
              with --only peer: it builds llama.cpp once (about 10 minutes on 2 cores)
A decode at context N runs on a synthesized random state with N - 1 cached tokens (the shapes and
scales a prefill would leave), not on a prefilled one. PyTorch and IREE get the same number of
threads (one by default).
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import iree.runtime as rt
import ml_dtypes
import numpy as np
import torch
from iree.compiler.tools.core import find_tool

from . import DEFAULT_MAX_PROMPT
from .build import build_bundle, compile_model, export_cached, meta_model, published_dtypes
from ..artifacts.bundle import Bundle, open_bundle, stored_dtypes
from ..errors import K3Error
from ..model import K3Config, K3Model
from ..model.accounting import account
from ..model.checkpoint import load_checkpoint
from ..model.config import every_fourth_and_last
from ..model.convert import save_checkpoint
from ..model.init import init_weights
from ..exporter.entry_points import Pool
from ..exporter.export import stacked_state
from ..model.model import K3State
from ..passes.pipeline import Pipeline
from ..runtimes.readback import to_device
from ..runtimes.session import Session
from ..runtimes.tokenizer import write_byte_level_tokenizer
from ..utils.memory import keep_freed_heap
from . import bench_ops
from .bench_devices import bench_devices
from .bench_peer import bench_peer
from .bench_serve import SERVE_POOL, bench_serve
from .bench_report import SECTIONS
from ..compiler import cpu as cpu_levels
from ..compiler.devices import check_device
from ..compiler.targets import Target, parse_target
from ..ops import OPS, mxfp4_gemv
from ..ops.linear import TILE


@dataclass(frozen=True)
class Sizes:
    """What a run measures: the model, the lengths and shapes of each section, and how often."""
    preset: str
    max_prompt: int
    decode_contexts: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    layer_tokens: tuple[int, ...]  # prefill of one KDA / MLA / MoE layer part
    kda_tokens: tuple[int, ...]
    kda_scan_tokens: int
    moe: dict                      # experts E, top-k, latent L, expert hidden I
    copy_bytes: int
    hybrid_contexts: tuple[int, ...]
    compile_layers: tuple[int, ...]
    rounds: int                    # rounds of the fast cases (decode, kda, moe, hybrid)
    slow_rounds: int               # rounds of prefill (compile: one; its CPU time hardly moves with load)
    full_k3: bool                  # the compile section also compiles the full K3 (--no-weights)
    sections: tuple[str, ...] = SECTIONS


FULL = Sizes("k3-small", 2048, (128, 1024, 4096, 16384), (512, 2048, 8192), (512, 2048, 8192),
             (256, 512, 1024, 2048, 4096, 8192), 2048,
             {"E": 32, "k": 16, "L": 3584, "I": 3072}, 512 << 20, (1024, 4096, 16384), (8, 32, 93), 7, 3, True,
             tuple(s for s in SECTIONS if s != "peer"))
QUICK = Sizes("k3-tiny", DEFAULT_MAX_PROMPT, (16, 64, 256), (16, 64, DEFAULT_MAX_PROMPT + 76), (16, 64), (64, 128, 256, 512), 128,
              {"E": 8, "k": 2, "L": 256, "I": 256}, 32 << 20, (64, 128, 256), (1, 2), 3, 1, False,
              ("decode", "prefill", "kda", "moe"))  # hybrid and compile need whole models compiled


# ---- measuring ----------------------------------------------------------------------------------
def interleaved(cases: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each case, ``rounds`` samples each, taken round-robin after a warm-up."""
    for run in cases.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds):
        for name in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
            t0 = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def ratio(times: dict[str, list[float]], slow: str, fast: str) -> float:
    """Median over rounds of time(slow) / time(fast)."""
    return statistics.median(a / b for a, b in zip(times[slow], times[fast]))


def ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    level = cpu_levels.highest_level(cpu_levels.host_features())
    return {"cpu": cpu, "cpu_features": sorted(cpu_levels.host_features()),
            "cpu_level": level.name if level else None, "cores": os.cpu_count(), "memory_gib": round(os.sysconf("SC_PAGE_SIZE") *
            os.sysconf("SC_PHYS_PAGES") / 2**30, 1), "threads": torch.get_num_threads(),
            "load_average_start": os.getloadavg()[0], "python": platform.python_version()}


# ---- models and their compiled modules ----------------------------------------------------------
class TimedSession:
    """A bundle's module in an IREE session, called with device-resident state: what the decode,
    prefill and hybrid sections time."""

    def __init__(self, bundle: Bundle, driver: str | None = None):
        self.session = Session(bundle, driver)

    def on_device(self, state: K3State) -> list:
        """The state as the entry points take it (exporter/export.py stacked_state), on the device."""
        return [to_device(self.session.device, t.numpy()) for t in stacked_state(state)]

    def decode(self, token: np.ndarray, state: list) -> np.ndarray:
        logits, *_ = self.session.call["decode"](token, *state)
        return self.session.host(logits)

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        """Logits of every position; a prompt longer than the bundle's max_prompt is prefilled in
        pieces, as ``k3c run`` does (runtimes/session.py ``Session.prefill``)."""
        if ids.shape[1] > self.session.bundle.manifest.max_prompt:
            return self.session.prefill(ids[0])[0]
        logits, *_ = self.session.call["prefill"](ids)
        return self.session.host(logits)


def all_mla(cfg: K3Config) -> K3Config:
    """The same model with every attention layer Gated MLA (no KDA)."""
    plan = {"full_attn_layers": list(range(1, cfg.num_hidden_layers + 1)), "kda_layers": []}
    return dataclasses.replace(cfg, linear_attn_config={**cfg.linear_attn_config, **plan})


def with_layers(cfg: K3Config, n: int) -> K3Config:
    """``cfg`` at depth ``n`` with the published plan (MLA at every fourth layer and the last)."""
    full = every_fourth_and_last(n)
    plan = {"full_attn_layers": full, "kda_layers": [i for i in range(1, n + 1) if i not in full]}
    return dataclasses.replace(cfg, num_hidden_layers=n, linear_attn_config={**cfg.linear_attn_config, **plan})


def checkpoint_for(cfg: K3Config, path: Path, seed: int, log) -> Path:
    """A seeded random checkpoint of ``cfg`` at ``path``, written unless one of this config is there."""
    if (path / "config.json").is_file() and K3Config.from_hf(path).hash == cfg.hash:
        return path
    log(f"writing a random checkpoint of {cfg.hash} to {path}")
    save_checkpoint(init_weights(K3Model(cfg), seed), path)
    return path


def bench_bundle(path: Path, checkpoint: Path, target: Target, max_prompt: int, log,
                 pool: Pool | None = None) -> tuple[Bundle, K3Model]:
    """The bundle at ``path`` if it was built from ``checkpoint`` and its module is the one the
    compile cache holds for it (so a source change rebuilds it), else a new one (with a sequence
    ``pool``); and the eager model on the same weights."""
    model = load_checkpoint(checkpoint, dtype=torch.float32).eval()
    try:
        bundle = open_bundle(path)
        fresh = compile_model(model, stored_dtypes(checkpoint), target, max_prompt=max_prompt, pool=pool,
                              log=log).vmfb
        if (bundle.manifest.max_prompt == max_prompt and bundle.checkpoint_dir.resolve() == checkpoint.resolve()
                and bundle.module_path.read_bytes() == fresh):
            return bundle, model
    except K3Error:
        pass
    return build_bundle(path, target, checkpoint=checkpoint, max_prompt=max_prompt, pool=pool, log=log), model


def synthetic_state(model: K3Model, cached: int, seed: int = 0) -> K3State:
    """A decode state with ``cached`` tokens seen: random values at the scales prefill leaves."""
    gen = torch.Generator().manual_seed(seed)
    init = model.init_state(1)
    width = model.cfg.mla_cache_width
    return K3State([torch.randn(t.shape, generator=gen) for t in init.kda_conv],
                   [0.1 * torch.randn(t.shape, generator=gen) for t in init.kda_S],
                   [torch.randn(1, cached, width, generator=gen) for _ in init.mla_cache])


# ---- sections -----------------------------------------------------------------------------------
def active_weight_bytes(cfg: K3Config) -> int:
    """Weight bytes a decode token reads, as stored (docs/model.md §6): everything but the embedding table
    (one row is looked up) and the routed experts, plus the top-k experts of each MoE layer."""
    f = account(cfg)
    b = f["bytes_by_component"]
    routed = b.get("routed_experts", 0)
    picked = (f["params_active_per_token"] - f["params_trunk"]) // max(f["params_per_routed_expert"], 1)
    return f["bytes_total"] - b.get("embedding", 0) - routed + picked * routed // max(f["routed_experts"], 1)


class Copy:
    """The reference for the roofline figures: a large copy between two page-aligned buffers, by as
    many threads as the compiled side runs (each copies one page-aligned slice; numpy's copy leaves
    the GIL). With glibc keeping freed memory in the heap (``keep_freed_heap``, as a Session does),
    numpy's buffers come from the heap at any 16-byte offset; where the destination sits 16 bytes
    past the source modulo 4 KiB, each load waits on a store to an address with the same low 12 bits
    (4K aliasing) and a 512 MiB copy ran at 9 GB/s (read + write) instead of 29 (AMD EPYC, Zen 3):
    the reference must be the machine's streaming bandwidth, not its allocator's offsets."""

    def __init__(self, nbytes: int, threads: int = 1):
        self.src, self.dst = _page_aligned(nbytes), _page_aligned(nbytes)
        self.src.fill(1.0)
        self.dst.fill(0.0)
        self.nbytes = self.src.nbytes
        step = -(-self.src.size // threads // 512) * 512  # 512 float64 = one page
        self.slices = [slice(i, i + step) for i in range(0, self.src.size, step)]
        self.pool = ThreadPoolExecutor(len(self.slices)) if len(self.slices) > 1 else None

    def __call__(self) -> None:
        if self.pool is None:
            np.copyto(self.dst, self.src)
        else:
            list(self.pool.map(lambda s: np.copyto(self.dst[s], self.src[s]), self.slices))


def _page_aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start:start + nbytes // 8 * 8].view(np.float64)


def bench_decode(compiled: TimedSession, model: K3Model, contexts, rounds: int, copy: Copy, log) -> dict:
    """Compiled vs eager per token; at the first and last context (128 and 16k in the full run) also
    the copy in the same rounds, for the decode roofline fraction: (active weight bytes / compiled
    time) / copy bandwidth (read + write)."""
    token = np.array([[1]], dtype=np.int64)
    active = active_weight_bytes(model.cfg)
    rows = []
    for n in contexts:
        state = synthetic_state(model, n - 1)
        on_device = compiled.on_device(state)
        cases = {"eager": lambda: model.decode(torch.from_numpy(token), state),
                 "compiled": lambda: compiled.decode(token, on_device)}
        if n in (contexts[0], contexts[-1]):
            cases["copy"] = copy
        with torch.no_grad():
            times = interleaved(cases, rounds)
        rows.append({"context": n, "eager_ms": ms(times["eager"]), "compiled_ms": ms(times["compiled"]),
                     "speedup": ratio(times, "eager", "compiled")})
        if "copy" in times:
            rows[-1].update(copy_GBps=2 * copy.nbytes / statistics.median(times["copy"]) / 1e9,
                            weight_GBps=active / statistics.median(times["compiled"]) / 1e9,
                            roofline_fraction=ratio(times, "copy", "compiled") * active / (2 * copy.nbytes))
        log(f"decode at context {n}: {rows[-1]['compiled_ms']:.1f} ms compiled, {rows[-1]['eager_ms']:.1f} ms eager")
    return {"state": "synthesized random state with context - 1 cached tokens", "active_weight_bytes": active,
            "rows": rows}


def bench_prefill(compiled: TimedSession, model: K3Model, lengths, rounds: int, log) -> dict:
    rows = []
    for T in lengths:
        ids = np.random.default_rng(T).integers(0, model.cfg.vocab_size, (1, T))
        with torch.no_grad():
            times = interleaved({"eager": lambda: model.prefill(torch.from_numpy(ids)),
                                 "compiled": lambda: compiled.prefill(ids)}, rounds)
        rows.append({"tokens": T, "eager_tok_s": T / statistics.median(times["eager"]),
                     "compiled_tok_s": T / statistics.median(times["compiled"]),
                     "speedup": ratio(times, "eager", "compiled")})
        log(f"prefill {T} tokens: {rows[-1]['compiled_tok_s']:.0f} tok/s compiled, {rows[-1]['eager_tok_s']:.0f} eager")
    return {"rows": rows}


def bench_layers(model: K3Model, tokens, target: Target, rounds: int, log) -> dict:
    """Prefill of one layer part of each kind (KDA attention, MLA attention, MoE block; the first
    layer of each), compiled vs eager, at each token count."""
    cfg = model.cfg
    first = {}
    for i, layer in enumerate(model.model.layers):
        first.setdefault(layer.kind, i)
        if hasattr(layer, "block_sparse_moe"):
            first.setdefault("moe", i)
    rows = []
    for part in ("kda", "mla", "moe"):
        if part not in first:
            continue
        module = bench_ops.LayerPrefill(model.model.layers[first[part]], part, cfg.conv_size).eval()
        _, compiled = _load(bench_ops.layer_module(module, cfg.hash, first[part], max(tokens), target, log))
        for T in tokens:
            x = torch.randn(1, T, cfg.hidden_size, generator=torch.Generator().manual_seed(T))
            with torch.no_grad():
                times = interleaved({"eager": lambda: module(x), "compiled": lambda: compiled(x.numpy()).to_host()},
                                    rounds)
            rows.append({"part": part, "layer": first[part], "tokens": T, "eager_ms": ms(times["eager"]),
                         "compiled_ms": ms(times["compiled"]), "speedup": ratio(times, "eager", "compiled")})
            log(f"{part} layer prefill at T = {T}: {rows[-1]['compiled_ms']:.0f} ms compiled, "
                f"{rows[-1]['eager_ms']:.0f} ms eager")
    return {"rows": rows}


def _load(vmfb: bytes):
    config = rt.Config("local-task")
    return config.device, rt.load_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb), config).main


def bench_kda(cfg: K3Config, sizes: Sizes, target: Target, rounds: int, log) -> dict:
    H, K = cfg.kda_heads, cfg.kda_head_dim
    top = max(sizes.kda_tokens)
    device, chunkwise = _load(bench_ops.kda_module(H, K, top, "chunkwise", target, log))
    _, token_scan = _load(bench_ops.kda_module(H, K, top, "token_scan", target, log))
    inputs = {T: [rt.asdevicearray(device, a) for a in bench_ops.kda_inputs(T, H, K)] for T in sizes.kda_tokens}
    cases = {f"chunkwise {T}": (lambda x=inputs[T]: chunkwise(*x)[0].to_host()) for T in sizes.kda_tokens}
    scan_T = sizes.kda_scan_tokens
    cases[f"token_scan {scan_T}"] = lambda: token_scan(*inputs[scan_T])[0].to_host()
    times = interleaved(cases, rounds)
    base = sizes.kda_tokens[len(sizes.kda_tokens) // 2 - 1]
    out = {"heads": H, "head_dim": K,
           "rows": [{"tokens": T, "chunkwise_ms": ms(times[f"chunkwise {T}"])} for T in sizes.kda_tokens],
           "token_scan": {"tokens": scan_T, "ms": ms(times[f"token_scan {scan_T}"])},
           "growth": {"from": base, "to": top, "ratio": ratio(times, f"chunkwise {top}", f"chunkwise {base}"),
                      "linear": top / base},
           "chunkwise_vs_token_scan": ratio(times, f"token_scan {scan_T}", f"chunkwise {scan_T}")}
    log(f"kda: time({top})/time({base}) = {out['growth']['ratio']:.2f}; chunkwise "
        f"{out['chunkwise_vs_token_scan']:.1f}x faster than token by token at T = {scan_T}")
    return out


def mxfp4_kernel(target: Target, L: int, I: int) -> str:
    """The MXFP4 decode kernel ``target`` runs on experts L -> I -> L: "native:<level>" (the C
    kernel's variant), "f16" or "int" (the linalg forms; ops/mxfp4_gemv.py)."""
    if target.backend != "llvm-cpu":
        return "dequantised"
    return mxfp4_gemv.form(f"native:{target.level}", (L, I)) if target.level in TILE else "int"


def bench_moe(cfg: K3Config, sizes: Sizes, target: Target, rounds: int, copy: Copy, log) -> dict:
    E, k, L, I = (sizes.moe[x] for x in "EkLI")
    act = (cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    token, mx = bench_ops.moe_inputs(E, k, L, I)
    bf16 = [bench_ops.as_bf16(mx[i], mx[i + 1]) for i in (0, 2, 4)]
    device, mx_fn = _load(bench_ops.moe_module("mxfp4", act, token, mx, target, log))
    _, bf_fn = _load(bench_ops.moe_module("bf16", act, token, bf16, target, log))
    tok = [rt.asdevicearray(device, a) for a in token]
    mx_dev = [rt.asdevicearray(device, a) for a in mx]
    bf_dev = [rt.asdevicearray(device, w.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)) for w in bf16]
    del bf16
    y_mx, y_bf = mx_fn(*tok, *mx_dev).to_host(), bf_fn(*tok, *bf_dev).to_host()
    times = interleaved({"copy": copy, "mxfp4": lambda: mx_fn(*tok, *mx_dev).to_host(),
                         "bf16": lambda: bf_fn(*tok, *bf_dev).to_host()}, rounds)
    mx_bytes = k * sum(a[0].nbytes for a in mx)  # the k picked experts' packed weights and scales
    bf_bytes = k * 3 * I * L * 2
    copy_gbs = 2 * copy.nbytes / statistics.median(times["copy"]) / 1e9
    out = {"shape": sizes.moe, "mxfp4_bytes_per_token": mx_bytes, "bf16_bytes_per_token": bf_bytes,
           "copy_bytes": copy.nbytes, "copy_GBps": copy_gbs,
           "mxfp4_ms": ms(times["mxfp4"]), "bf16_ms": ms(times["bf16"]),
           "mxfp4_GBps": mx_bytes / statistics.median(times["mxfp4"]) / 1e9,
           "bf16_GBps": bf_bytes / statistics.median(times["bf16"]) / 1e9,
           # both against the same rounds' copy: (bytes/t_moe) / (2 * copy bytes / t_copy)
           "mxfp4_fraction_of_copy": ratio(times, "copy", "mxfp4") * mx_bytes / (2 * copy.nbytes),
           "mxfp4_over_bf16_speedup": ratio(times, "bf16", "mxfp4"),
           "mxfp4_vs_bf16_max_rel_diff": float(np.abs(y_mx - y_bf).max() / np.abs(y_bf).max())}
    out["mxfp4_kernel"] = mxfp4_kernel(target, L, I)
    log(f"moe: {out['mxfp4_kernel']} kernel, mxfp4 {out['mxfp4_GBps']:.1f} GB/s of weights, copy {copy_gbs:.1f} GB/s, "
        f"{out['mxfp4_over_bf16_speedup']:.2f}x faster than bf16")
    return out


def bench_hybrid(hybrid: tuple[TimedSession, K3Model], mla: tuple[TimedSession, K3Model], contexts, rounds: int, log) -> dict:
    token = np.array([[1]], dtype=np.int64)
    rows = []
    for n in contexts:
        states = [c.on_device(synthetic_state(m, n - 1)) for c, m in (hybrid, mla)]
        times = interleaved({"hybrid": lambda: hybrid[0].decode(token, states[0]),
                             "all_mla": lambda: mla[0].decode(token, states[1])}, rounds)
        rows.append({"context": n, "hybrid_ms": ms(times["hybrid"]), "all_mla_ms": ms(times["all_mla"]),
                     "advantage": ratio(times, "all_mla", "hybrid")})
        log(f"hybrid at context {n}: {rows[-1]['advantage']:.2f}x faster than all-MLA")
    return {"rows": rows}


# Runs a command and reports its wall and CPU time and peak memory. It runs in a small helper
# process because Linux counts the memory a child had before exec (a copy of its parent's) in the
# child's peak: spawned from this process, iree-compile would report this process's size.
_MEASURE = """import json, resource, subprocess, sys, time
t0 = time.perf_counter()
r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
u = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": r.returncode, "wall_s": time.perf_counter() - t0, "cpu_s": u.ru_utime + u.ru_stime,
                  "peak_MiB": u.ru_maxrss / 1024, "error": (r.stderr.strip().splitlines() or [""])[-1]}))"""


def iree_compile(mlir: Path, target: Target) -> dict:
    """Run the iree-compile tool on ``mlir`` with the flags compile_mlir uses: wall and CPU seconds
    (user + system, all its threads) and peak resident memory."""
    cmd = [find_tool("iree-compile"), str(mlir), "--iree-input-type=torch", *target.flags, "-o", os.devnull]
    report = json.loads(subprocess.run([sys.executable, "-c", _MEASURE, *cmd], capture_output=True, text=True,
                                       check=True).stdout)
    if report.pop("rc"):
        raise K3Error(f"bench: iree-compile failed on {mlir}: {report['error']}")
    del report["error"]
    return report


# The targets for the compile cost (docs/pipeline.md §5): at up to 4x the first depth (32 / 8
# layers) at most 1.5x its iree-compile CPU time and peak memory, further (93 / 8) at most 2x; the
# full K3 (--no-weights) within 8 GiB on every target of FULL_K3_TARGETS.
FULL_K3_TARGETS = ("cpu", "cuda:sm_80")
FULL_K3_PEAK_MIB = 8 * 1024


def depth_limit(first: int, n: int) -> float:
    """The largest cost ratio allowed at ``n`` layers over ``first``."""
    return 1.5 if n <= 4 * first else 2.0


def _lowered(cfg: K3Config, target: Target, max_prompt: int, path: Path, log) -> Path:
    """``path``: what iree-compile gets for ``cfg`` and ``target`` (exported from shapes, lowered)."""
    module, _ = export_cached(meta_model(cfg), published_dtypes(cfg), max_prompt=max_prompt, log=log)
    Pipeline.for_target(target).run(module, log=lambda m: None)
    path.write_text(str(module))
    return path


def bench_compile(cfg: K3Config, sizes: Sizes, target: Target, work: Path, log) -> dict:
    """iree-compile of the lowered module at each depth of ``cfg``'s widths on ``target``, then of the
    full K3 (``--no-weights``) on each of FULL_K3_TARGETS, once each. Judged on CPU time and peak
    memory: a compile runs for minutes, too long to interleave, and its CPU time hardly moves with
    other load."""
    files = {n: _lowered(with_layers(cfg, n), target, sizes.max_prompt,
                         work / f"compile-{cfg.hash}-{n}-layers.mlir", log) for n in sizes.compile_layers}
    rows = []
    for n, path in files.items():
        rows.append({"layers": n, **iree_compile(path, target)})
        log(f"iree-compile at {n} layers: {rows[-1]['wall_s']:.0f} s wall, {rows[-1]['cpu_s']:.0f} s CPU, "
            f"{rows[-1]['peak_MiB']:.0f} MiB peak")
    first = rows[0]
    ratios = [{"from": first["layers"], "to": r["layers"], "limit": depth_limit(first["layers"], r["layers"]),
               **{k: r[k] / first[k] for k in ("cpu_s", "wall_s", "peak_MiB")}} for r in rows[1:]]
    full = []
    for spec in FULL_K3_TARGETS if sizes.full_k3 else ():
        t = parse_target(spec)
        path = _lowered(K3Config(), t, DEFAULT_MAX_PROMPT, work / f"compile-k3-{t.name.replace(':', '-')}.mlir", log)
        full.append({"target": t.name, **iree_compile(path, t)})
        log(f"iree-compile of the full K3 for {t.name}: {full[-1]['wall_s']:.0f} s wall, "
            f"{full[-1]['cpu_s']:.0f} s CPU, {full[-1]['peak_MiB']:.0f} MiB peak")
    return {"rows": rows, "ratios": ratios, "full_k3": full, "full_k3_limit_MiB": FULL_K3_PEAK_MIB}


# ---- the whole run ------------------------------------------------------------------------------
def use_threads(n: int) -> None:
    """n threads for PyTorch and for IREE's local-task workers alike. IREE reads the worker count
    when the process first creates its local-task driver (listing the driver's devices creates it
    too: compiler/devices.py), and keeps it: called after that, it leaves every IREE call on all
    cores (k3-small decode ran 1.5x faster than on one). On a small shared machine one thread each
    keeps the comparison fair: threads that wait on each other under load from other processes slow
    eager PyTorch by up to 10x."""
    torch.set_num_threads(n)
    rt.flags.parse_flags(f"--task_topology_group_count={n}")


def run_bench(sizes: Sizes, work: Path, sections=None, target: str = "cpu", threads: int = 1, log=print) -> dict:
    """Run ``sections`` (default: those of ``sizes``) at ``sizes`` with ``threads`` threads on each
    side; the JSON-ready results."""
    sections = sections or sizes.sections
    use_threads(threads)
    tgt = parse_target(target)
    check_device(tgt)     # after use_threads: it creates the driver (use_threads)
    keep_freed_heap()   # for the compiled side, as a Session does; eager PyTorch allocates from it too
    copy = Copy(sizes.copy_bytes, threads) if {"decode", "moe"} & set(sections) else None
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    cfg = K3Config.preset(sizes.preset)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(), "target": tgt.name, "target_cpu_features": list(tgt.cpu_features),
              "lowerings": {op.name: op.lowering(tgt).doc for op in OPS},
              "sizes": dataclasses.asdict(sizes), "sections": {}}
    out = result["sections"]
    if {"decode", "prefill", "hybrid"} & set(sections):
        ck = checkpoint_for(cfg, work / f"{sizes.preset}-checkpoint", 0, log)
        bundle, model = bench_bundle(work / sizes.preset, ck, tgt, sizes.max_prompt, log)
        compiled = TimedSession(bundle)
    elif "layers" in sections:
        ck = checkpoint_for(cfg, work / f"{sizes.preset}-checkpoint", 0, log)
        model = load_checkpoint(ck, dtype=torch.float32).eval()
    for name in sections:
        t0 = time.perf_counter()
        log(f"bench {name} ...")
        if name == "decode":
            out[name] = bench_decode(compiled, model, sizes.decode_contexts, sizes.rounds, copy, log)
        elif name == "prefill":
            out[name] = bench_prefill(compiled, model, sizes.prefill_tokens, sizes.slow_rounds, log)
        elif name == "layers":
            out[name] = bench_layers(model, sizes.layer_tokens, tgt, sizes.slow_rounds, log)
        elif name == "kda":
            out[name] = bench_kda(cfg, sizes, tgt, sizes.rounds, log)
        elif name == "moe":
            out[name] = bench_moe(cfg, sizes, tgt, sizes.rounds, copy, log)
        elif name == "hybrid":
            mla_cfg = all_mla(cfg)
            ck = checkpoint_for(mla_cfg, work / f"{sizes.preset}-all-mla-checkpoint", 0, log)
            mla_bundle, mla_model = bench_bundle(work / f"{sizes.preset}-all-mla", ck, tgt, sizes.max_prompt, log)
            out[name] = bench_hybrid((compiled, model), (TimedSession(mla_bundle), mla_model), sizes.hybrid_contexts,
                                     sizes.rounds, log)
        elif name == "compile":
            out[name] = bench_compile(cfg, sizes, tgt, work, log)
        elif name == "serve":   # a checkpoint of its own: the server needs a tokenizer beside the weights
            ck_serve = checkpoint_for(cfg, work / f"{sizes.preset}-serve-checkpoint", 0, log)
            if not (ck_serve / "tokenizer.json").is_file():
                write_byte_level_tokenizer(ck_serve, cfg.vocab_size)
            served, _ = bench_bundle(work / f"{sizes.preset}-serve", ck_serve, tgt, sizes.max_prompt, log, SERVE_POOL)
            out[name] = bench_serve(served, threads, sizes.slow_rounds, log)
        elif name == "peer":
            out[name] = bench_peer(work, tgt, sizes.slow_rounds, log)
        elif name == "devices":
            out[name] = bench_devices(K3Config.preset("k3-tiny"), work, tgt, 128, sizes.rounds, log)
        out[name]["seconds"] = time.perf_counter() - t0
        log(f"bench {name} done in {out[name]['seconds']:.0f} s")
    result["machine"]["load_average_end"] = os.getloadavg()[0]
    return result

"""The peer section of ``k3c bench`` (``--only peer``): k3c against llama.cpp on one Kimi Linear
checkpoint, on this machine, at one thread and at every core, side by side in one run.

The checkpoint is the Hub layout, made by transformers' ``KimiLinearForCausalLM`` at ``PEER_MODEL``
(1.02 B parameters, 336 M active per token) in bf16, in two weight formats: bf16 throughout, and its
routed experts in MXFP4 (``k3c quantize`` for k3c, ``llama-quantize`` for llama.cpp:
the same 4-bit format, every other tensor left bf16).

llama.cpp is the tree vendored in the ``llama-cpp-python`` sdist (``LLAMA_CPP_PYTHON``, from the
package registry), its ``llama-bench`` and ``llama-quantize`` built once with cmake for this CPU
(``GGML_NATIVE``) into the k3c cache; its own ``convert_hf_to_gguf.py`` writes the GGUF. The bench
checkpoint has no tokenizer, so the GGUF takes llama.cpp's 32,000-token Llama SPM test vocabulary
(``models/ggml-vocab-llama-spm.gguf``) for llama-bench to load it; both engines are fed token ids.

Measured as llama-bench measures: the prefill of 512 tokens from an empty context (``pp512``, the
logits of the last) and 128 decode steps (``tg128``), tokens/s. Each k3c measurement runs in a
process of its own (IREE's worker count is set once per process); rounds alternate the engines'
order, and each figure is the median over rounds. ``*_over_llamacpp``: k3c's tokens/s over
llama.cpp's, the lowest over weight formats and thread counts.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import DEFAULT_MAX_PROMPT
from ..errors import K3Error
from ..utils.files import atomic_dir, cache_dir, cache_lock, seal_entry, verified_entry

LLAMA_CPP_PYTHON = "0.3.36"   # its vendored llama.cpp: commit 0c1e570
PROMPT, DECODE = 512, 128
# the bench checkpoint: [3 KDA, MLA] x 2, a dense first layer, then 32 experts top-4 and a shared one
PEER_MODEL = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=4096, moe_intermediate_size=512, num_hidden_layers=8,
    num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=32, num_experts_per_token=4,
    num_shared_experts=1, moe_renormalize=True, routed_scaling_factor=2.446, first_k_dense_replace=1,
    hidden_act="silu", rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    linear_attn_config={"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8], "num_heads": 16,
                        "head_dim": 128, "short_conv_kernel_size": 4})
TOOLS = ("llama-bench", "llama-quantize")
VOCAB = "models/ggml-vocab-llama-spm.gguf"
CONVERTER = ("convert_hf_to_gguf.py", "conversion", "gguf-py", VOCAB)   # what the cache keeps of the tree
# llama-quantize: MXFP4_MOE puts the routed experts (the 3-D *_exps tensors) in MXFP4 and the rest
# in Q8_0; the override keeps the rest bf16, as k3c quantize does (overrides apply to quantised types only)
MXFP4_EXPERTS = ("--tensor-type", "^(?!.*_exps).*=bf16", "MXFP4_MOE")


@dataclass
class LlamaCpp:
    root: Path       # the cache entry: bin/ (the tools) and src/ (the converter and the vocabulary)

    def tool(self, name: str) -> str:
        return str(self.root / "bin" / name)


def _run(cmd: list[str], what: str, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise K3Error(f"bench peer: {what} failed (exit {r.returncode}): {tail[0][:300]}")
    return r


def llama_cpp(log) -> LlamaCpp:
    """llama.cpp's tools for this CPU and its converter, from the cache (checked file by file) or
    built: the sdist from the package registry, cmake, about 10 minutes on 2 cores."""
    from ..compiler.cpu import host_features
    from .build import cache_key
    entry = cache_dir() / "llama.cpp" / cache_key(version=LLAMA_CPP_PYTHON, cpu=sorted(host_features()))
    with cache_lock(entry, log):
        if verified_entry(entry, tuple(f"bin/{t}" for t in TOOLS), log):
            return LlamaCpp(entry)
        for tool in ("cmake", "c++"):
            if shutil.which(tool) is None:
                raise K3Error(f"bench peer: building llama.cpp needs {tool}, which is not on PATH")
        with tempfile.TemporaryDirectory(prefix="k3c-llama-") as scratch, atomic_dir(entry) as tmp:
            scratch = Path(scratch)
            log(f"downloading llama-cpp-python {LLAMA_CPP_PYTHON} (sdist) for its llama.cpp")
            _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                  f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(scratch)], "pip download of llama-cpp-python")
            [sdist] = scratch.glob("llama_cpp_python-*.tar.gz")
            with tarfile.open(sdist) as tar:
                tar.extractall(scratch, filter="data")
            tree = scratch / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
            t0 = time.perf_counter()
            log("building llama-bench and llama-quantize (cmake, GGML_NATIVE)")
            _run(["cmake", "-S", str(tree), "-B", str(scratch / "build"), "-DCMAKE_BUILD_TYPE=Release",
                  "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                  "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                  "-DLLAMA_BUILD_APP=OFF"], "cmake configure of llama.cpp")
            _run(["cmake", "--build", str(scratch / "build"), "-j", str(os.cpu_count() or 1), "--target", *TOOLS],
                 "cmake build of llama.cpp")
            log(f"built llama.cpp in {time.perf_counter() - t0:.0f} s")
            (tmp / "bin").mkdir()
            for t in TOOLS:
                shutil.copy2(scratch / "build" / "bin" / t, tmp / "bin" / t)
            for part in CONVERTER:
                src, dst = tree / part, tmp / "src" / part
                dst.parent.mkdir(parents=True, exist_ok=True)
                (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
            seal_entry(tmp)
    return LlamaCpp(entry)


def _stamped(stamp: Path, text: str) -> bool:
    """Whether ``stamp`` says ``text``: what the file beside it was made from."""
    return stamp.is_file() and stamp.read_text() == text


def bench_checkpoint(path: Path, log) -> Path:
    """The bench's Kimi Linear checkpoint (``PEER_MODEL``, seeded, bf16) at ``path``, written by
    transformers unless the one of these sizes is there (its ``peer.json`` says so)."""
    stamp = json.dumps({"model": PEER_MODEL, "seed": 0}, sort_keys=True)
    if _stamped(path / "peer.json", stamp):
        return path
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    log(f"writing the Kimi Linear bench checkpoint (transformers) to {path}")
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(KimiLinearConfig(**PEER_MODEL)).to(torch.bfloat16)
    # transformers names the dense first layer's MLP block_sparse_moe.*; the Hub files name it mlp.*
    dense = re.compile(r"(model\.layers\.\d+)\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.")
    with atomic_dir(path) as tmp:
        model.save_pretrained(tmp)
        del model
        saved = tmp / "model.safetensors"
        tensors = {dense.sub(r"\1.mlp.\2.", k): v for k, v in load_file(saved).items()}
        save_file(tensors, saved, metadata={"format": "pt"})
        raw = json.loads((tmp / "config.json").read_text())  # a key the Hub config has, transformers' lacks
        (tmp / "config.json").write_text(json.dumps({**raw, "moe_router_activation_func": "sigmoid"}, indent=2))
        (tmp / "peer.json").write_text(stamp)
    return path


def mxfp4_checkpoint(bf16: Path, path: Path, log) -> Path:
    """``bf16`` with its routed experts in MXFP4 (``k3c quantize``) at ``path``, unless made from it already."""
    from .checkpoints import quantize
    stamp = (bf16 / "peer.json").read_text()
    if not _stamped(path / "peer.json", stamp):
        quantize(bf16, path, force=True, log=log)
        (path / "peer.json").write_text(stamp)
    return path


def gguf_files(llama: LlamaCpp, checkpoint: Path, work: Path, log) -> dict[str, Path]:
    """The checkpoint as llama.cpp's converter writes it (bf16) and quantised by llama-quantize with
    the routed experts in MXFP4; written once per checkpoint into ``work``."""
    out = {"bf16": work / "peer-bf16.gguf", "mxfp4": work / "peer-mxfp4-experts.gguf"}
    stamp = work / "peer-gguf.json"
    want = json.dumps({"checkpoint": (checkpoint / "peer.json").read_text(), "llama": llama.root.name})
    if _stamped(stamp, want) and all(p.is_file() for p in out.values()):
        return out
    stamp.unlink(missing_ok=True)
    t0 = time.perf_counter()
    _run([sys.executable, "-m", "k3c.interface.bench_peer", "convert", str(llama.root / "src"), str(checkpoint),
          str(out["bf16"])], "llama.cpp's convert_hf_to_gguf.py", timeout=1800)
    _run([llama.tool("llama-quantize"), *MXFP4_EXPERTS[:2], str(out["bf16"]), str(out["mxfp4"]), MXFP4_EXPERTS[2]],
         "llama-quantize", timeout=1800)
    stamp.write_text(want)
    log(f"wrote {out['bf16'].name} and {out['mxfp4'].name} in {time.perf_counter() - t0:.0f} s")
    return out


def convert(src: Path, checkpoint: Path, out: Path) -> None:
    """Run llama.cpp's converter (in this process: ``python -m k3c.interface.bench_peer convert``) on
    ``checkpoint``, with the vocabulary of ``VOCAB`` in place of the checkpoint's (it has none)."""
    import runpy
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    import gguf
    from conversion.kimi_linear import KimiLinearModel

    def set_vocab(self):
        reader = gguf.GGUFReader(src / VOCAB)
        for name, field in reader.fields.items():
            if name.startswith("tokenizer."):
                self.gguf_writer.add_key_value(name, field.contents(), field.types[0],
                                               field.types[1] if len(field.types) > 1 else None)
    KimiLinearModel.set_vocab = set_vocab
    sys.argv = ["convert_hf_to_gguf.py", str(checkpoint), "--outtype", "bf16", "--outfile", str(out)]
    runpy.run_path(str(src / "convert_hf_to_gguf.py"), run_name="__main__")


def llama_side(llama: LlamaCpp, gguf_file: Path, threads: int) -> dict:
    """llama-bench's pp512 and tg128 on ``threads`` threads, one repetition (after its warm-up)."""
    r = _run([llama.tool("llama-bench"), "-m", str(gguf_file), "-p", str(PROMPT), "-n", str(DECODE),
              "-t", str(threads), "-r", "1", "-o", "json"], "llama-bench", timeout=1800)
    runs = json.loads(r.stdout)
    tok_s = {("prefill" if x["n_prompt"] else "decode"): x["avg_ts"] for x in runs}
    return {**tok_s, "build_commit": runs[0].get("build_commit"), "cpu_info": runs[0].get("cpu_info"),
            "backends": runs[0].get("backends")}


def k3c_side(bundle: Path, threads: int) -> dict:
    """k3c's prefill and decode tokens/s on ``threads`` IREE workers, in a fresh process."""
    r = _run([sys.executable, "-m", "k3c.interface.bench_peer", "time", str(bundle), str(threads)], "k3c timing",
             timeout=1800)
    return json.loads(r.stdout.strip().splitlines()[-1])


def time_bundle(bundle: Path, threads: int) -> dict:
    """What ``k3c_side`` reads: llama-bench's two measurements on a k3c bundle, after a warm-up
    (``python -m k3c.interface.bench_peer time``)."""
    import iree.runtime as rt
    import numpy as np
    from ..artifacts.bundle import open_bundle
    from ..runtimes.session import Session
    rt.flags.parse_flags(f"--task_topology_group_count={threads}")
    session = Session(open_bundle(bundle))
    ids = np.random.default_rng(0).integers(3, session.vocab, PROMPT)

    def prefill() -> float:
        t0 = time.perf_counter()
        session.prefill(ids, last_only=True)
        return time.perf_counter() - t0

    def decode(steps: int) -> float:
        session.prefill(ids[:1], last_only=True)
        t0 = time.perf_counter()
        for token in ids[1:steps + 1]:
            session.decode(int(token))
        return time.perf_counter() - t0

    decode(4)   # the warm-up: the first call of each entry point maps the weights in
    return {"prefill": PROMPT / prefill(), "decode": DECODE / decode(DECODE)}


def k3c_bundle(path: Path, checkpoint: Path, target, log) -> Path:
    """The bundle at ``path`` if it holds the module the compile cache has for ``checkpoint`` now
    (a source change compiles again), else a new one; logs the compile's wall time."""
    from ..artifacts.bundle import open_bundle, stored_dtypes
    from ..model.config import K3Config
    from .build import build_bundle, compile_model, meta_model
    t0 = time.perf_counter()
    module = compile_model(meta_model(K3Config.from_hf(checkpoint)), stored_dtypes(checkpoint), target,
                           max_prompt=DEFAULT_MAX_PROMPT, log=log).vmfb
    try:
        bundle = open_bundle(path)
        if bundle.manifest.checkpoint == str(checkpoint.resolve()) and bundle.module_path.read_bytes() == module:
            return path
    except K3Error:
        pass
    build_bundle(path, target, checkpoint=checkpoint, log=log)
    log(f"k3c bundle of {checkpoint.name} in {time.perf_counter() - t0:.0f} s")
    return path


def bench_peer(work: Path, target, rounds: int, log) -> dict:
    """The section: both engines, both weight formats, 1 and every thread, ``rounds`` rounds."""
    llama = llama_cpp(log)
    ck = {"bf16": bench_checkpoint(work / "peer-kimi-linear-bf16", log)}
    ck["mxfp4"] = mxfp4_checkpoint(ck["bf16"], work / "peer-kimi-linear-mxfp4", log)
    ggufs = gguf_files(llama, ck["bf16"], work, log)
    bundles = {fmt: k3c_bundle(work / f"peer-k3c-{fmt}", path, target, log) for fmt, path in ck.items()}
    threads = sorted({1, os.cpu_count() or 1})
    samples: dict[tuple, list[dict]] = {}
    for r in range(rounds):
        for fmt in ck:
            for n in threads:
                sides = [("llama.cpp", lambda: llama_side(llama, ggufs[fmt], n)),
                         ("k3c", lambda: k3c_side(bundles[fmt], n))]
                for engine, measure in (sides if r % 2 == 0 else sides[::-1]):
                    samples.setdefault((fmt, n, engine), []).append(measure())
                    log(f"peer round {r + 1}/{rounds}: {engine} {fmt} {n} thread(s): "
                        f"{samples[(fmt, n, engine)][-1]['prefill']:.1f} prefill, "
                        f"{samples[(fmt, n, engine)][-1]['decode']:.2f} decode tok/s")
    rows = []
    for (fmt, n, engine), runs in samples.items():
        rows.append({"format": fmt, "threads": n, "engine": engine,
                     "prefill_tok_s": statistics.median(x["prefill"] for x in runs),
                     "decode_tok_s": statistics.median(x["decode"] for x in runs)})
    by = {(r["format"], r["threads"], r["engine"]): r for r in rows}
    over = {what: min(by[(f, n, "k3c")][f"{what}_tok_s"] / by[(f, n, "llama.cpp")][f"{what}_tok_s"]
                      for f in ck for n in threads) for what in ("prefill", "decode")}
    first = samples[(next(iter(ck)), threads[0], "llama.cpp")][0]
    return {"model": PEER_MODEL,
            "llama_cpp": {"llama_cpp_python": LLAMA_CPP_PYTHON, "build_commit": first["build_commit"],
                          "cpu_info": first["cpu_info"], "backends": first["backends"],
                          "mxfp4": "llama-quantize " + " ".join(MXFP4_EXPERTS)},
            "prompt": PROMPT, "decode_steps": DECODE, "rounds": rounds, "rows": rows,
            "prefill_over_llamacpp": over["prefill"], "decode_over_llamacpp": over["decode"]}


if __name__ == "__main__":
    if sys.argv[1] == "convert":
        convert(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
    elif sys.argv[1] == "time":
        print(json.dumps(time_bundle(Path(sys.argv[2]), int(sys.argv[3]))))

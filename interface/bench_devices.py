"""``k3c bench --only devices`` (README "Past one device"): one expert-heavy model compiled for 1, 2
(and 4 where the host has 4 cores) local CPU devices (one thread each), decode and prefill tokens/s timed in the same rounds,
reported as ratios to one device on the driver the N-device sessions use (on the CPU local-sync,
runtimes/session.py ``MULTI_DEVICE_DRIVER``: the ratio is then the split's own, not a difference
between drivers; the ratio to one device on its own driver is reported too, not judged); the
transfer overhead is timed on its own, by a program that
makes only the moves of the N-device program (the hidden rows to each device and its partial sum
back, per MoE layer) with no expert work.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
from pathlib import Path

import numpy as np
import torch

from ..compiler.devices import open_devices
from ..compiler.targets import Target, compile_mlir, on_devices
from ..model import K3Config
from ..runtimes.session import MULTI_DEVICE_DRIVER

# k3-tiny's trunk with 32 experts of 512 hidden over a latent of 256, top-8: the routed experts
# are ~90% of a decode step's work (what splitting them can speed up)
EXPERT_HEAVY = {"num_experts": 32, "num_experts_per_token": 8, "moe_intermediate_size": 512,
                "routed_expert_hidden_size": 256}
COUNTS = (1, 2, 4) if (os.cpu_count() or 1) >= 4 else (1, 2)   # one thread per device: 4 where cores allow
CONTEXT, PREFILL_TOKENS = 64, 64


def expert_heavy(cfg: K3Config) -> K3Config:
    return dataclasses.replace(cfg, **EXPERT_HEAVY)


def moves_program(cfg: K3Config, n: int, tokens: int) -> str:
    """MLIR of ``moves``: for each MoE layer, z [tokens, L] to devices 1..n-1, doubled there (so the
    move is used), and back to device 0, added up."""
    L = cfg.expert_input_size
    t = f"tensor<{tokens}x{L}xf32>"
    on = lambda d: f"#hal.device.promise<@__device_{d}>"
    lines = [f"func.func @moves(%z: {t} {{iree.abi.affinity = {on(0)}}}) -> ({t} {{iree.abi.affinity = {on(0)}}}) {{"]
    acc, i = "%z", 0
    for _ in range(sum(map(cfg.is_moe, range(cfg.num_hidden_layers)))):
        for d in range(1, n):
            lines += [f"  %x{i} = flow.tensor.transfer {acc} : {t} to {on(d)}",
                      f"  %y{i} = arith.addf %x{i}, %x{i} : {t}",
                      f"  %b{i} = flow.tensor.transfer %y{i} : {t} to {on(0)}",
                      f"  %a{i} = arith.addf {acc}, %b{i} : {t}"]
            acc, i = f"%a{i}", i + 1
    lines += [f"  return {acc} : {t}", "}"]
    return "\n".join(lines)


def time_moves(cfg: K3Config, target: Target, tokens: int, rounds: int) -> float:
    """Median seconds of one call of ``moves_program`` on ``target``'s devices."""
    import iree.runtime as rt
    from .bench import interleaved

    vmfb = compile_mlir(moves_program(cfg, target.devices, tokens), target, log=lambda _: None)
    found = open_devices(MULTI_DEVICE_DRIVER.get(target.driver, target.driver), target.devices)   # as Session
    config = rt.Config(device=found[0])
    config.default_vm_modules = (rt.create_hal_module(config.vm_instance, devices=found),)
    module = rt.VmModule.copy_buffer(config.vm_instance, vmfb)
    context = rt.SystemContext(vm_modules=[module], config=config)
    moves = context.modules.module["moves"]
    z = np.ones((tokens, cfg.expert_input_size), dtype=np.float32)
    run = lambda: np.array(moves(z).to_host(), copy=True)
    run()
    return statistics.median(interleaved({"moves": run}, rounds)["moves"])


def bench_devices(cfg: K3Config, work: Path, target: Target, max_prompt: int, rounds: int, log) -> dict:
    """Decode (context CONTEXT) and prefill (PREFILL_TOKENS) tokens/s of ``expert_heavy(cfg)`` on
    COUNTS local devices, in the same interleaved rounds; ratios to one device; the moves' time."""
    from .bench import TimedSession, bench_bundle, checkpoint_for, interleaved, synthetic_state

    heavy = expert_heavy(cfg)
    ck = checkpoint_for(heavy, work / "expert-heavy-checkpoint", 0, log)
    sessions, model = {}, None
    for n in COUNTS:
        bundle, model = bench_bundle(work / f"expert-heavy-x{n}", ck, on_devices(target, n), max_prompt, log)
        sessions[n] = TimedSession(bundle)
        if n == 1:
            sessions["1 same driver"] = TimedSession(bundle, MULTI_DEVICE_DRIVER.get(target.driver, target.driver))
    token = np.array([[1]], dtype=np.int64)
    state = synthetic_state(model, CONTEXT - 1)
    ids = np.random.default_rng(0).integers(0, heavy.vocab_size, (1, PREFILL_TOKENS))
    cases = {}
    for n, s in sessions.items():
        on_device = s.on_device(state)
        cases[f"decode x{n}"] = lambda s=s, st=on_device: s.decode(token, st)
        cases[f"prefill x{n}"] = lambda s=s: s.prefill(ids)
    with torch.no_grad():
        times = {k: statistics.median(v) for k, v in interleaved(cases, rounds).items()}
    rows = []
    one_decode, one_prefill = times["decode x1 same driver"], times["prefill x1 same driver"]
    for n in COUNTS:
        decode_s, prefill_s = times[f"decode x{n}"], times[f"prefill x{n}"]
        row = {"devices": n, "decode_tok_s": 1 / decode_s, "prefill_tok_s": PREFILL_TOKENS / prefill_s,
               "decode_vs_one": one_decode / decode_s, "prefill_vs_one": one_prefill / prefill_s,
               "decode_vs_one_own_driver": times["decode x1"] / decode_s,
               "prefill_vs_one_own_driver": times["prefill x1"] / prefill_s}
        if n > 1:
            tgt = on_devices(target, n)
            row["moves_decode_ms"] = 1e3 * time_moves(heavy, tgt, 1, rounds)
            row["moves_prefill_ms"] = 1e3 * time_moves(heavy, tgt, PREFILL_TOKENS, rounds)
            row["moves_share_of_decode"] = row["moves_decode_ms"] / 1e3 / decode_s
            row["moves_share_of_prefill"] = row["moves_prefill_ms"] / 1e3 / prefill_s
        rows.append(row)
        log(f"devices x{n}: decode {row['decode_tok_s']:.1f} tok/s ({row['decode_vs_one']:.2f}x one device on "
            f"the same driver, {row['decode_vs_one_own_driver']:.2f}x on its own), prefill "
            f"{row['prefill_tok_s']:.0f} tok/s ({row['prefill_vs_one']:.2f}x, {row['prefill_vs_one_own_driver']:.2f}x)"
            + (f", moves {row['moves_decode_ms']:.2f} ms per decode step" if n > 1 else ""))
    return {"config": EXPERT_HEAVY, "context": CONTEXT, "prefill_tokens": PREFILL_TOKENS, "rows": rows}

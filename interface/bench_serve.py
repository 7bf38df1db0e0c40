"""The serve section of ``k3c bench`` (``--only serve``): ``k3c serve`` on a bundle compiled for
serving (``SERVE_POOL``), under 1, 2, 4 and 8 concurrent streams, against ``k3c run`` alone.

The server runs in a process of its own with the bench's IREE thread count (``python -m
k3c.interface.bench_serve BUNDLE PORT THREADS``), on loopback; each stream is a greedy
``/v1/completions`` request of ``PROMPT`` prompt tokens (each stream its own) for exactly
``TOKENS`` tokens (end of sequence barred), streamed as server-sent events, and timed chunk by
chunk on arrival. ``k3c run`` is ``Session.generate`` on the same bundle in this process, same
prompt length and tokens. Each round runs every concurrency and the run once, the order reversed
every other round; judged figures are medians over rounds of per-round ratios:

    aggregate decode tokens/s at N    the tokens that arrive while all N streams decode (from the
                                      last stream's first token to the first stream's last) over
                                      that time
    one stream's decode tokens/s      its tokens after the first over the time from the first to
                                      the last, against the run's decode tokens/s
Also reported: output tokens/s (every stream's tokens over the wall time from the first request
to the last token, the prompts' prefill included), and time to first token and the gaps between
a stream's tokens, pooled over streams and rounds (p50, p99).
"""
from __future__ import annotations

import http.client
import json
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import K3Error
from ..exporter.entry_points import Pool

STREAMS = (1, 2, 4, 8)
PROMPT, TOKENS = 32, 96
SERVE_POOL = Pool(context=512, max_batch=max(STREAMS))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(bundle, threads: int, log) -> tuple[subprocess.Popen, int]:
    """The server process on a free loopback port, once its /health answers 200 (K3Error if it
    exits or is not healthy within 300 s)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "k3c.interface.bench_serve", str(bundle.root), str(port),
                             str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise K3Error(f"bench: the server exited {proc.returncode}: {proc.stderr.read().strip()[-300:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                log(f"serve: server up on port {port}")
                return proc, port
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise K3Error("bench: the server did not become healthy in 300 s")


def stream(port: int, prompt: list[int], eos: list[int]) -> tuple[float, list[float]]:
    """One streamed greedy completion of TOKENS tokens: (when it was sent, when each token's chunk
    arrived), perf_counter seconds."""
    body = json.dumps({"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "stream": True,
                       "logit_bias": {str(i): -100 for i in eos}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise K3Error(f"bench: the server answered {response.status}: {response.read()[:300]!r}")
    arrivals = []
    for line in response:
        if line.startswith(b"data: {"):
            arrivals.append(time.perf_counter())
    conn.close()
    if len(arrivals) != TOKENS:
        raise K3Error(f"bench: a stream gave {len(arrivals)} tokens, not {TOKENS}")
    return sent, arrivals


def concurrent(port: int, n: int, vocab: int, eos: list[int], seed: int) -> dict:
    """``n`` streams at once, each its own prompt."""
    rng = np.random.default_rng(seed)
    prompts = [[int(i) for i in rng.integers(3, vocab, PROMPT)] for _ in range(n)]
    with ThreadPoolExecutor(n) as pool:
        runs = list(pool.map(lambda p: stream(port, p, eos), prompts))
    first_sent = min(sent for sent, _ in runs)
    start, end = max(a[0] for _, a in runs), min(a[-1] for _, a in runs)
    together = sum(start < t <= end for _, a in runs for t in a)
    return {"decode_tokens_per_s": together / (end - start),
            "output_tokens_per_s": n * TOKENS / (max(a[-1] for _, a in runs) - first_sent),
            "ttft_s": [a[0] - sent for sent, a in runs],
            "itl_s": [b - a for _, arr in runs for a, b in zip(arr, arr[1:])],
            "decode_tok_s": [(TOKENS - 1) / (a[-1] - a[0]) for _, a in runs]}


def bench_serve(bundle, threads: int, rounds: int, log) -> dict:
    from ..runtimes.session import Session
    from ..runtimes.tokenizer import bundle_tokenizer

    vocab = bundle.manifest.config["vocab_size"]
    eos = sorted(bundle_tokenizer(bundle).eos_ids)
    session = Session(bundle)
    proc, port = start_server(bundle, threads, log)
    samples = {n: [] for n in STREAMS}
    run_tok_s = []
    try:
        concurrent(port, max(STREAMS), vocab, eos, seed=0)      # warm-up: every batch size once
        for r in range(rounds):
            cases = [*STREAMS, "run"]
            for case in cases if r % 2 == 0 else cases[::-1]:
                if case == "run":
                    prompt = np.random.default_rng(r).integers(3, vocab, PROMPT)
                    run_tok_s.append(session.generate(prompt, TOKENS).decode_tok_s)
                else:
                    samples[case].append(concurrent(port, case, vocab, eos, seed=100 * r + case))
            log(f"serve round {r + 1}/{rounds}: decode " + ", ".join(
                f"{n} streams {samples[n][-1]['decode_tokens_per_s']:.1f} tok/s" for n in STREAMS)
                + f"; run {run_tok_s[-1]:.1f} tok/s")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    one = [s["decode_tok_s"][0] for s in samples[1]]
    rows = [{"streams": n, **{what: statistics.median(s[what] for s in samples[n])
                              for what in ("decode_tokens_per_s", "output_tokens_per_s")},
             **{f"{what}_p{q}_ms": 1e3 * float(np.percentile([x for s in samples[n] for x in s[f"{what}_s"]], q))
                for what in ("ttft", "itl") for q in (50, 99)}}
            for n in STREAMS]
    top = max(STREAMS)
    return {"prompt": PROMPT, "tokens": TOKENS, "pool": SERVE_POOL.to_dict(), "rounds": rounds, "rows": rows,
            "run_decode_tok_s": statistics.median(run_tok_s),
            "one_stream_decode_tok_s": statistics.median(one),
            "aggregate_over_one": statistics.median(a["decode_tokens_per_s"] / b["decode_tokens_per_s"]
                                                    for a, b in zip(samples[top], samples[1])),
            "one_stream_over_run": statistics.median(a / b for a, b in zip(one, run_tok_s))}


def _serve_main(bundle: str, port: str, threads: str) -> None:
    """The bench's server: ``k3c serve`` with ``threads`` IREE workers."""
    import iree.runtime as rt

    from .serve import serve
    rt.flags.parse_flags(f"--task_topology_group_count={int(threads)}")
    serve(bundle, "127.0.0.1", int(port), None, "bench", None, 64, log=lambda _: None)


if __name__ == "__main__":
    _serve_main(*sys.argv[1:])

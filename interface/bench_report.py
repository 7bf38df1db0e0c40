"""The targets of ``k3c bench`` judged on its results, as a Markdown table and a plot."""
from __future__ import annotations

import io
import os
from pathlib import Path

from ..errors import K3Error

from ..utils.files import write_atomic

# the sections of ``k3c bench``, in the order they run and are reported (runtimes/bench.py)
SECTIONS = ("decode", "prefill", "layers", "kda", "moe", "hybrid", "compile", "devices", "serve", "peer")
PART_NAMES = {"kda": "KDA", "mla": "MLA", "moe": "MoE"}


def _row(figure: str, value: float, target: str, met: bool, fmt: str = "{:.2f}x") -> dict:
    return {"figure": figure, "measured": fmt.format(value), "value": value, "target": target, "met": bool(met)}


def targets(sections: dict) -> list[dict]:
    """One row per judged figure present in ``sections``."""
    rows = []
    if "decode" in sections:
        for r in sections["decode"]["rows"]:
            rows.append(_row(f"decode speedup at context {r['context']}", r["speedup"], ">= 3x", r["speedup"] >= 3))
        for r in sections["decode"]["rows"]:
            if "roofline_fraction" in r:
                rows.append(_row(f"decode roofline fraction at context {r['context']} (active weight bytes/s over copy)",
                                 r["roofline_fraction"], ">= 40%", r["roofline_fraction"] >= 0.4, "{:.1%}"))
        first, last = sections["decode"]["rows"][0], sections["decode"]["rows"][-1]
        growth = last["compiled_ms"] / first["compiled_ms"]
        rows.append(_row(f"compiled decode time, context {last['context']} / {first['context']}", growth,
                         "> 1 (grows with the context used)", growth > 1))
    if "prefill" in sections:
        for r in sections["prefill"]["rows"]:
            rows.append(_row(f"prefill speedup at T = {r['tokens']}", r["speedup"], ">= 3x", r["speedup"] >= 3))
    if "layers" in sections:
        for r in sections["layers"]["rows"]:
            rows.append(_row(f"{PART_NAMES[r['part']]} layer prefill speedup at T = {r['tokens']}", r["speedup"],
                             ">= 1x", r["speedup"] >= 1))
    if "kda" in sections:
        k = sections["kda"]
        g = k["growth"]
        limit = 1.25 * g["linear"]
        rows.append(_row(f"KDA chunkwise time({g['to']}) / time({g['from']})", g["ratio"], f"<= {limit:g}",
                         g["ratio"] <= limit))
        rows.append(_row(f"KDA chunkwise vs token-by-token at T = {k['token_scan']['tokens']}",
                         k["chunkwise_vs_token_scan"], ">= 5x", k["chunkwise_vs_token_scan"] >= 5))
    if "moe" in sections:
        m = sections["moe"]
        rows.append(_row("MXFP4 expert FFN weight bytes/s over copy bandwidth", m["mxfp4_fraction_of_copy"],
                         ">= 40%", m["mxfp4_fraction_of_copy"] >= 0.4, "{:.1%}"))
        rows.append(_row("MXFP4 experts vs bf16 experts (decode step)", m["mxfp4_over_bf16_speedup"], ">= 2x",
                         m["mxfp4_over_bf16_speedup"] >= 2))
    if "hybrid" in sections:
        adv = [r["advantage"] for r in sections["hybrid"]["rows"]]
        ctx = "/".join(str(r["context"]) for r in sections["hybrid"]["rows"])
        rows.append({"figure": f"hybrid vs all-MLA decode advantage at {ctx}", "value": adv,
                     "measured": ", ".join(f"{a:.2f}x" for a in adv), "target": "grows with context",
                     "met": all(b > a for a, b in zip(adv, adv[1:]))})
    if "devices" in sections:
        for r in sections["devices"]["rows"][1:]:
            rows.append(_row(f"decode on {r['devices']} local devices vs one on the same driver (expert-heavy)", r["decode_vs_one"],
                             ">= 1.5x" if r["devices"] == 2 else "> 1x",
                             r["decode_vs_one"] >= (1.5 if r["devices"] == 2 else 1)))
    if "serve" in sections:
        sv = sections["serve"]
        top = sv["rows"][-1]["streams"]
        rows.append(_row(f"k3c serve aggregate decode tokens/s, {top} streams over 1", sv["aggregate_over_one"], ">= 4x",
                         sv["aggregate_over_one"] >= 4))
        rows.append(_row("k3c serve one stream's decode tokens/s over k3c run's", sv["one_stream_over_run"],
                         ">= 0.9x (within 10%)", sv["one_stream_over_run"] >= 0.9))
    if "peer" in sections:
        p = sections["peer"]
        for what in ("decode", "prefill"):
            rows.append(_row(f"k3c {what} tok/s over llama.cpp's, same checkpoint and threads (lowest over "
                             "bf16 / MXFP4 experts and thread counts)", p[f"{what}_over_llamacpp"], ">= 1x",
                             p[f"{what}_over_llamacpp"] >= 1))
    if "compile" in sections:
        c = sections["compile"]
        for r in c["ratios"]:
            rows.append(_row(f"iree-compile CPU time, {r['to']} / {r['from']} layers (wall: {r['wall_s']:.2f}x)",
                             r["cpu_s"], f"<= {r['limit']:g}x", r["cpu_s"] <= r["limit"]))
            rows.append(_row(f"iree-compile peak memory, {r['to']} / {r['from']} layers", r["peak_MiB"],
                             f"<= {r['limit']:g}x", r["peak_MiB"] <= r["limit"]))
        for r in c["full_k3"]:
            rows.append(_row(f"iree-compile peak memory, full K3 --no-weights, {r['target']} ({r['cpu_s']:.0f} s CPU)",
                             r["peak_MiB"] / 1024, f"<= {c['full_k3_limit_MiB'] / 1024:g} GiB",
                             r["peak_MiB"] <= c["full_k3_limit_MiB"], "{:.2f} GiB"))
    return rows


def markdown(result: dict) -> str:
    """One run: the machine (CPU, its features, the kernel of each op), the judged figures as a table,
    then the absolute medians."""
    m = result["machine"]
    features = (f" (level {m.get('cpu_level')}; {' '.join(m['cpu_features'])})" if m.get("cpu_features")
                else " (CPU features not recorded)")
    peer_only = list(result["sections"]) == ["peer"]   # its own checkpoint and thread counts
    threads = "1 and every thread (peer)" if peer_only else f"{m['threads']} thread(s) for PyTorch and for IREE"
    model = "the peer's Kimi Linear checkpoint" if peer_only else f"model {result['sizes']['preset']}"
    lines = [f"Machine: {m['cpu']}{features}, {m['cores']} cores, {m['memory_gib']} GiB, {threads}, "
             f"load average {m['load_average_start']:.1f} at start, "
             f"{m.get('load_average_end', float('nan')):.1f} at end; "
             f"target {result['target']}, {model}; sections run: "
             f"{', '.join(result['sections'])}.", ""]
    if result.get("lowerings"):
        lines += ["Kernels (the lowering of each op on this target):", ""]
        lines += [f"- `k3::{op}`: {doc}" for op, doc in result["lowerings"].items()] + [""]
    lines += ["| figure | measured | target | met |", "|---|---:|---|:---:|"]
    lines += [f"| {t['figure']} | {t['measured']} | {t['target']} | {'yes' if t['met'] else '**no**'} |"
              for t in result["targets"]]
    lines += ["", "Absolute medians (not judged):", ""]
    s = result["sections"]
    if "decode" in s:
        lines.append("- decode ms/token (compiled / eager): " + ", ".join(
            f"{r['context']}: {r['compiled_ms']:.1f} / {r['eager_ms']:.1f}" for r in s["decode"]["rows"])
            + f" ({s['decode']['state']})")
        roof = [r for r in s["decode"]["rows"] if "roofline_fraction" in r]
        if roof:
            lines.append(f"- decode weight bytes/s ({s['decode']['active_weight_bytes'] / 1e6:.1f} MB active per token): "
                         + ", ".join(f"{r['context']}: {r['weight_GBps']:.2f} GB/s, copy {r['copy_GBps']:.1f} GB/s"
                                     for r in roof))
    if "prefill" in s:
        lines.append("- prefill tok/s (compiled / eager): " + ", ".join(
            f"T={r['tokens']}: {r['compiled_tok_s']:.0f} / {r['eager_tok_s']:.0f}" for r in s["prefill"]["rows"]))
    if "layers" in s:
        lines.append("- layer prefill ms (compiled / eager): " + ", ".join(
            f"{r['part']} T={r['tokens']}: {r['compiled_ms']:.0f} / {r['eager_ms']:.0f}" for r in s["layers"]["rows"]))
    if "kda" in s:
        k = s["kda"]
        lines.append(f"- KDA chunkwise ms (H={k['heads']}, K={k['head_dim']}): " + ", ".join(
            f"{r['tokens']}: {r['chunkwise_ms']:.1f}" for r in k["rows"])
            + f"; token by token at {k['token_scan']['tokens']}: {k['token_scan']['ms']:.1f}")
    if "moe" in s:
        mo = s["moe"]
        kernel = f" ({mo['mxfp4_kernel']} kernel)" if "mxfp4_kernel" in mo else ""
        lines.append(f"- MoE decode step {mo['shape']}: MXFP4{kernel} {mo['mxfp4_ms']:.2f} ms ({mo['mxfp4_GBps']:.1f} GB/s "
                     f"of {mo['mxfp4_bytes_per_token'] / 1e6:.1f} MB), bf16 {mo['bf16_ms']:.2f} ms "
                     f"({mo['bf16_GBps']:.1f} GB/s of {mo['bf16_bytes_per_token'] / 1e6:.1f} MB), "
                     f"copy {mo['copy_GBps']:.1f} GB/s (read + write)")
    if "hybrid" in s:
        lines.append("- decode ms/token (hybrid / all-MLA): " + ", ".join(
            f"{r['context']}: {r['hybrid_ms']:.1f} / {r['all_mla_ms']:.1f}" for r in s["hybrid"]["rows"]))
    if "compile" in s:
        lines.append("- iree-compile: " + ", ".join(
            f"{r['layers']} layers {r['wall_s']:.0f} s wall, {r['cpu_s']:.0f} s CPU, {r['peak_MiB']:.0f} MiB peak"
            for r in s["compile"]["rows"])
            + "".join(f"; full K3 for {r['target']} {r['wall_s']:.0f} s wall, {r['cpu_s']:.0f} s CPU, "
                      f"{r['peak_MiB']:.0f} MiB peak" for r in s["compile"]["full_k3"]))
    if "serve" in s:
        sv = s["serve"]
        lines.append(f"- k3c serve ({sv['prompt']}-token prompts, {sv['tokens']} tokens each, pool of "
                     f"{sv['pool']['max_batch']}): " + ", ".join(
                         f"{r['streams']} streams {r['decode_tokens_per_s']:.1f} decode, {r['output_tokens_per_s']:.1f} "
                         f"output tok/s (TTFT p50/p99 {r['ttft_p50_ms']:.0f}/"
                         f"{r['ttft_p99_ms']:.0f} ms, ITL p50/p99 {r['itl_p50_ms']:.1f}/{r['itl_p99_ms']:.1f} ms)"
                         for r in sv["rows"])
                     + f"; one stream decode {sv['one_stream_decode_tok_s']:.1f} tok/s, k3c run "
                       f"{sv['run_decode_tok_s']:.1f} tok/s")
    if "peer" in s:
        p = s["peer"]
        lines += [f"Peer (llama.cpp {p['llama_cpp']['build_commit']} from llama-cpp-python "
                  f"{p['llama_cpp']['llama_cpp_python']}, {p['llama_cpp']['backends']} backend, "
                  f"{p['llama_cpp']['cpu_info']}; MXFP4 experts: `{p['llama_cpp']['mxfp4']}`), tokens/s, "
                  f"median of {p['rounds']} interleaved rounds:", "",
                  f"| weights | threads | llama.cpp prefill {p['prompt']} | k3c prefill {p['prompt']} | "
                  f"llama.cpp decode {p['decode_steps']} | k3c decode {p['decode_steps']} |", "|---|---:|---:|---:|---:|---:|"]
        by = {(r["format"], r["threads"], r["engine"]): r for r in p["rows"]}
        for fmt, n in dict.fromkeys((r["format"], r["threads"]) for r in p["rows"]):
            ll, k = by[(fmt, n, "llama.cpp")], by[(fmt, n, "k3c")]
            lines.append(f"| {fmt} | {n} | {ll['prefill_tok_s']:.1f} | {k['prefill_tok_s']:.1f} | "
                         f"{ll['decode_tok_s']:.2f} | {k['decode_tok_s']:.2f} |")
    return "\n".join(lines) + "\n"


PAGE_HEAD = """# Benchmarks

Written by `{command}` from the runs below (their JSON beside this page); not edited by hand.
Every judged figure is a ratio of measurements interleaved in one run, one thread on each side
unless the run says otherwise; absolute times hold only for the machine they were measured on.
How each section measures: `k3c bench --help` and interface/bench.py.
"""


def read_runs(paths, relative_to: Path) -> list[tuple[str, dict]]:
    """(name relative to the page, result) of each JSON run; one ``K3Error`` line for a file that is
    not a run."""
    import json
    runs = []
    for p in map(Path, paths):
        try:
            result = json.loads(p.read_text())
            result["sections"], result["machine"]["cpu"]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise K3Error(f"bench: {p} is not a run written by k3c bench --json ({type(e).__name__}: {e})") from None
        runs.append((os.path.relpath(p, relative_to), result))
    return runs


def where_run(machine: dict, target: str) -> str:
    """", <level>" of the host, or ", <level> code on an <level> host" where the run's target is
    another CPU level (the AVX2 code benched on an AVX-512 host)."""
    host, code = machine.get("cpu_level") or "", target.partition("cpu:")[2]
    if code and code != host:
        return f", {code} code on an {host} host" if host else f", {code} code"
    return f", {host}" if host else ""


def page(runs: list[tuple[str, dict]], command: str, where: Path) -> str:
    """The benchmarks page at ``where``: for each (JSON name relative to it, result) its sections, date
    and command, ``markdown``, and the run's plot where a PNG of the JSON's name lies beside it."""
    parts = [PAGE_HEAD.format(command=command)]
    for name, result in runs:
        m = result["machine"]
        title = f"{', '.join(result['sections'])} ({m['cpu']}{where_run(m, result.get('target', ''))})"
        plot_name = str(Path(name).with_suffix(".png"))
        shown = f"\n![{title}]({plot_name})\n" if (where.parent / plot_name).is_file() else ""
        parts.append(f"## {title}\n\n`{result.get('command', 'k3c bench')}` on {result.get('date', 'an unrecorded date')} "
                     f"([{name}]({name})).\n\n{markdown(result)}{shown}")
    return "\n".join(parts)


def plot(result: dict, out: Path) -> None:
    """One panel per section present; written atomically to ``out`` (PNG)."""
    import matplotlib  # deferred heavy optional import (~1 s): only --plot draws
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["sections"]
    panels = [name for name in SECTIONS if name in s]
    cols = min(3, len(panels))
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.6 * cols, 3.6 * rows_n), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, panels):
        rows = s[name].get("rows", [])
        if name == "decode":
            x = [r["context"] for r in rows]
            ax.plot(x, [r["eager_ms"] for r in rows], "o-", label="eager")
            ax.plot(x, [r["compiled_ms"] for r in rows], "o-", label="compiled")
            ax.set(xscale="log", yscale="log", xlabel="context", ylabel="ms / token", title="decode")
        elif name == "prefill":
            x = [str(r["tokens"]) for r in rows]
            ax.bar([i - 0.2 for i in range(len(x))], [r["eager_tok_s"] for r in rows], 0.4, label="eager")
            ax.bar([i + 0.2 for i in range(len(x))], [r["compiled_tok_s"] for r in rows], 0.4, label="compiled")
            ax.set(xticks=range(len(x)), xticklabels=x, xlabel="prompt tokens", ylabel="tokens / s", title="prefill")
        elif name == "layers":
            for part in dict.fromkeys(r["part"] for r in rows):
                pr = [r for r in rows if r["part"] == part]
                ax.plot([r["tokens"] for r in pr], [r["speedup"] for r in pr], "o-", label=part)
            x = sorted({r["tokens"] for r in rows})
            ax.axhline(1, color="gray", ls=":")
            ax.set(xscale="log", xlabel="T", ylabel="eager / compiled", title="layer prefill")
        elif name == "kda":
            x = [r["tokens"] for r in rows]
            ax.plot(x, [r["chunkwise_ms"] for r in rows], "o-", label="chunkwise")
            ax.plot(x, [rows[0]["chunkwise_ms"] * t / x[0] for t in x], ":", color="gray", label="linear")
            ax.plot([s[name]["token_scan"]["tokens"]], [s[name]["token_scan"]["ms"]], "s", label="token by token")
            ax.set(xscale="log", yscale="log", xlabel="T", ylabel="ms", title="KDA prefill op")
        elif name == "moe":
            m = s[name]
            ax.bar(["copy", "MXFP4", "bf16"], [m["copy_GBps"], m["mxfp4_GBps"], m["bf16_GBps"]])
            ax.set(ylabel="GB/s (weights read; copy: read + write)", title="MoE decode step")
        elif name == "hybrid":
            x = [r["context"] for r in rows]
            ax.plot(x, [r["hybrid_ms"] for r in rows], "o-", label="hybrid")
            ax.plot(x, [r["all_mla_ms"] for r in rows], "o-", label="all MLA")
            ax.set(xscale="log", xlabel="context", ylabel="ms / token", title="decode, hybrid vs all-MLA")
        elif name == "compile":
            x = [r["layers"] for r in rows]
            ax.plot(x, [r["wall_s"] for r in rows], "o-", label="wall s")
            ax.plot(x, [r["cpu_s"] for r in rows], "o-", label="CPU s")
            ax2 = ax.twinx()
            ax2.plot(x, [r["peak_MiB"] for r in rows], "s--", color="C2", label="peak MiB")
            ax2.set_ylabel("peak MiB")
            ax.set(xlabel="layers", ylabel="s", title="iree-compile")
        elif name == "devices":
            x = [str(r["devices"]) for r in rows]
            ax.bar([i - 0.2 for i in range(len(x))], [r["decode_vs_one"] for r in rows], 0.4, label="decode")
            ax.bar([i + 0.2 for i in range(len(x))], [r["prefill_vs_one"] for r in rows], 0.4, label="prefill")
            ax.set(xticks=range(len(x)), xticklabels=x, xlabel="local devices", ylabel="tokens/s vs one device",
                   title="experts split over devices")
        elif name == "serve":
            x = [r["streams"] for r in rows]
            ax.plot(x, [r["decode_tokens_per_s"] for r in rows], "o-", label="aggregate decode")
            ax.plot(x, [r["output_tokens_per_s"] for r in rows], "s-", label="output (prefill included)")
            ax.plot(x, [rows[0]["decode_tokens_per_s"] * n for n in x], ":", color="gray", label="linear")
            ax.set(xlabel="concurrent streams", ylabel="tokens / s", title="k3c serve", xticks=x)
        elif name == "peer":
            cases = list(dict.fromkeys((r["format"], r["threads"]) for r in rows))
            by = {(r["format"], r["threads"], r["engine"]): r for r in rows}
            for j, engine in enumerate(("llama.cpp", "k3c")):
                ax.bar([i + 0.4 * j - 0.2 for i in range(len(cases))],
                       [by[(f, n, engine)]["decode_tok_s"] for f, n in cases], 0.4, label=engine)
            ax.set(xticks=range(len(cases)), xticklabels=[f"{f}, {n}t" for f, n in cases], ylabel="decode tokens / s",
                   title="vs llama.cpp (Kimi Linear 1B)")
        if ax.get_xscale() == "log":  # label the measured points, not the decades
            ax.set_xticks(x, [str(v) for v in x], rotation=45)
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    model = "Kimi Linear peer checkpoint" if list(s) == ["peer"] else result["sizes"]["preset"]
    fig.suptitle(f"k3c bench ({model}, {result['machine']['cpu']}, "
                 f"{result['machine']['cores']} cores)", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_atomic(Path(out), buf.getvalue())

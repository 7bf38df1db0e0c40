"""Smoke test of ``k3c bench --quick``: it runs every section and writes results that hold together.

The k3-tiny module comes from the suite's compile cache (``tiny_bundle`` compiled it, same config,
seed and max prompt); only the four toy op modules are compiled here. (--quick leaves out the
hybrid and compile sections, which compile whole models.)
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from k3c.cli import main
from k3c.interface.bench import QUICK


@pytest.mark.parametrize("target,says", [("cuda:sm_80", "give cpu or cpu:<level>"),
                                         ("cpu:x86-64-v4", "needs CPU features this CPU lacks: avx512f")])
def test_bench_refuses_a_target_it_cannot_run(target, says, monkeypatch, tmp_path):
    """The compiled side runs here, beside PyTorch: a GPU target, or a CPU level this CPU lacks
    (here an AVX2-only CPU asked for x86-64-v4), is one error line before anything is built."""
    from k3c.compiler import cpu
    monkeypatch.setattr(cpu, "host_features", lambda: frozenset(cpu.V3))
    result = CliRunner().invoke(main, ["bench", "--quick", "--target", target, "--work", str(tmp_path / "work")])
    assert result.exit_code == 1 and result.output.count("\n") == 1 and says in result.output, result.output
    assert not (tmp_path / "work").exists()


@pytest.mark.slow  # needs tiny_bundle (a whole-model compile)
def test_bench_quick_writes_json(tiny_bundle, k3c_cache, tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = CliRunner().invoke(main, ["bench", "--quick", "--json", str(out), "--plot", str(png),
                                       "--work", str(tmp_path / "work")], env={"K3C_CACHE": str(k3c_cache)})
    assert result.exit_code == 0, (result.output, result.exception)
    data = json.loads(out.read_text())
    assert set(data) >= {"machine", "target", "sizes", "sections", "targets"}
    assert list(data["sections"]) == list(QUICK.sections)
    sizes = data["sizes"]
    assert [r["context"] for r in data["sections"]["decode"]["rows"]] == sizes["decode_contexts"]
    assert [r["tokens"] for r in data["sections"]["prefill"]["rows"]] == sizes["prefill_tokens"]
    assert max(sizes["prefill_tokens"]) > sizes["max_prompt"]   # one prompt runs in pieces through extend
    assert [r["tokens"] for r in data["sections"]["kda"]["rows"]] == sizes["kda_tokens"]
    for row in data["sections"]["decode"]["rows"]:
        assert row["eager_ms"] > 0 and row["compiled_ms"] > 0 and row["speedup"] > 0
    # the bf16 experts hold exactly the MXFP4 values, so both modules compute the same FFN
    assert data["sections"]["moe"]["mxfp4_vs_bf16_max_rel_diff"] < 1e-5
    for t in data["targets"]:
        assert set(t) >= {"figure", "measured", "target", "met"} and isinstance(t["met"], bool)
    assert "| figure | measured | target | met |" in result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_times_every_concurrency(tiny_pool_bundle):
    """The serve section end to end on k3-tiny, one round: a server process, 1 to 8 streams of
    exactly its token count each, ``k3c run`` beside it; the judged ratios are those of its rows."""
    from k3c.interface.bench_serve import STREAMS, bench_serve

    out = bench_serve(tiny_pool_bundle, 1, 1, log=lambda _: None)
    rows = out["rows"]
    assert [r["streams"] for r in rows] == list(STREAMS)
    for r in rows:
        assert r["decode_tokens_per_s"] > 0 and r["output_tokens_per_s"] > 0
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and 0 < r["itl_p50_ms"] <= r["itl_p99_ms"]
    assert out["aggregate_over_one"] == pytest.approx(rows[-1]["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"])
    assert out["one_stream_over_run"] == pytest.approx(out["one_stream_decode_tok_s"] / out["run_decode_tok_s"])

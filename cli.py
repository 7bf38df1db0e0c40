"""The ``k3c`` command line: one verb per job (inspect, init-checkpoint, quantize, export, compile,
run, validate, bench, targets). Errors from bad input print one line and exit non-zero."""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import click

from .errors import K3Error


class _Group(click.Group):
    """Turns K3Error (and the OS errors of missing files) into ``error: ...`` and exit code 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (K3Error, FileNotFoundError, IsADirectoryError, PermissionError) as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)


@click.group(cls=_Group)
@click.version_option(package_name="k3c")
def main():
    """k3c: compile Kimi K3 / Kimi Linear checkpoints with IREE, run them, validate against PyTorch."""


def load_config(preset: str | None, config: str | None):
    from .model.config import K3Config
    if config:
        return K3Config.from_hf(config)
    return K3Config.preset(preset or "k3-tiny")


@main.command()
@click.option("--preset", default=None, help="k3, k3-small or k3-tiny (default k3-tiny).")
@click.option("--config", "config_dir", default=None, type=click.Path(), help="Checkpoint dir or config.json.")
@click.option("--context", default=1_048_576, show_default=True, type=click.IntRange(min=1),
              help="Context length for cache sizes and attention FLOPs.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def inspect(preset, config_dir, context, as_json):
    """Parameters, bytes, state and cache sizes, FLOPs per token, from shapes on the meta device.
    Writes nothing."""
    from .model.accounting import account, render
    figures = account(load_config(preset, config_dir), context)
    click.echo(json.dumps(figures, indent=2) if as_json else render(figures))


@main.command("balance-demo")
@click.option("--steps", default=3, show_default=True, type=click.IntRange(min=1), help="Bias updates.")
@click.option("--tokens", default=16384, show_default=True, type=click.IntRange(min=56),
              help="Tokens per batch (>= 56: a target load of at least one token per expert).")
@click.option("--seed", default=0, show_default=True, help="Seed of the synthetic router and its batches.")
def balance_demo(steps, tokens, seed):
    """Quantile Balancing against the sign rule at gamma 1e-4 ... 1e-1 (spec §4), on a synthetic
    skewed sigmoid router with 896 experts, top-16, a fresh batch per step."""
    from .model.balance import balance_demo as run_demo, render_history
    start = time.perf_counter()
    click.echo(render_history(run_demo(steps, tokens, seed)))
    click.echo(f"{steps} updates, {tokens:,} tokens per batch, {time.perf_counter() - start:.1f} s", err=True)


SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(ctx, param, value: str | None) -> int | None:
    """'2GB' -> 2_000_000_000, '512MiB' -> 536_870_912, '1000' -> 1000."""
    if value is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
    if not m or m[2].upper() not in SIZE_UNITS or float(m[1]) <= 0:
        raise click.BadParameter(f"{value!r} is not a size such as 2GB or 512MiB")
    return int(float(m[1]) * SIZE_UNITS[m[2].upper()])


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@main.command("init-checkpoint")
@click.option("--preset", required=True, help="k3, k3-small or k3-tiny.")
@click.option("--seed", default=0, show_default=True, help="Seed of the random weights.")
@click.option("--shard-size", default=None, callback=parse_size, help="Shard the weights, e.g. 2GB.")
@click.argument("out_dir", type=click.Path(file_okay=False))
def init_checkpoint(preset, seed, shard_size, out_dir):
    """Write a checkpoint of seeded random weights for a preset (same seed, same bytes)."""
    import torch
    from .model.convert import save_checkpoint
    from .model.init import init_weights
    from .model.model import K3Model
    cfg = load_config(preset, None)
    with torch.device("meta"):
        need = sum(t.numel() * t.element_size() for t in K3Model(cfg).state_dict().values())
    if need > physical_memory():
        raise K3Error(f"init-checkpoint: preset {preset} needs {need / 1e9:.0f} GB in memory, "
                      f"this machine has {physical_memory() / 1e9:.0f} GB")
    start = time.perf_counter()
    model = init_weights(K3Model(cfg), seed)
    click.echo(f"initialised {preset} with seed {seed} in {time.perf_counter() - start:.1f} s", err=True)
    start = time.perf_counter()
    save_checkpoint(model, out_dir, shard_size)
    files = sorted(Path(out_dir).iterdir())
    click.echo(f"wrote {out_dir}: {len(files)} files, {sum(f.stat().st_size for f in files) / 1e6:.1f} MB "
               f"in {time.perf_counter() - start:.1f} s", err=True)


@main.command()
@click.argument("in_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--show", default=20, show_default=True, help="Tensors listed, largest error first.")
def quantize(in_dir, out_dir, show):
    """Convert a checkpoint's float routed experts to MXFP4; other tensors are kept byte for byte."""
    from rich.console import Console
    from rich.table import Table
    from .model.convert import quantize_checkpoint
    start = time.perf_counter()
    report = quantize_checkpoint(in_dir, out_dir)
    click.echo(f"quantised {len(report)} tensors into {out_dir} in {time.perf_counter() - start:.1f} s", err=True)
    if not report:
        return
    table = Table(title="MXFP4 relative RMS error ||W_q - W|| / ||W||")
    table.add_column("tensor")
    table.add_column("shape")
    table.add_column("rel. RMS error", justify="right")
    for q in sorted(report, key=lambda q: (-q.rel_rms_error, q.name))[:show]:
        table.add_row(q.name, "x".join(map(str, q.shape)), f"{q.rel_rms_error:.4f}")
    errors = [q.rel_rms_error for q in report]
    table.caption = (f"{len(report)} tensors (largest {min(show, len(report))} shown): "
                     f"mean {sum(errors) / len(errors):.4f}, max {max(errors):.4f}")
    Console().print(table)

"""The ``k3c`` command line: one verb per job (inspect, init-checkpoint, quantize, export, compile,
run, validate, bench, targets). Errors from bad input print one line and exit non-zero."""
from __future__ import annotations

import json
import sys
import time

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

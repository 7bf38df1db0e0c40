"""The ``k3c`` command line: one verb per job (inspect, init-checkpoint, quantize, export, compile,
pack, attach, run, chat, validate, bench, targets). Errors from bad input print one line and exit non-zero.

Each verb imports what it runs inside its own function: deferred heavy imports (torch, IREE, rich's
tables), so that ``k3c --help``, a bad argument and the verbs that need neither answer at once."""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import sys
import time
from pathlib import Path

import click

from .errors import K3Error
from .interface import DEFAULT_MAX_PROMPT
from .interface.bench_report import SECTIONS as BENCH_SECTIONS


# what lowering and compiling import and running a bundle does not (docs/bundle.md: a machine that
# only runs bundles installs iree-base-runtime)
COMPILER_PACKAGES = ("iree.compiler", "torch_mlir", "onnxscript")


class _Group(click.Group):
    """Turns K3Error (and the OS errors of files k3c cannot read or write) into ``error: ...`` and
    exit code 1. SIGTERM unwinds like Ctrl-C (exit 143), so temporary outputs are removed and an
    iree-compile child is killed on the way out."""

    def invoke(self, ctx):
        signal.signal(signal.SIGTERM, _terminated)
        try:
            return super().invoke(ctx)
        except K3Error as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except OSError as e:
            click.echo(f"error: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""), err=True)
            sys.exit(1)
        except ModuleNotFoundError as e:
            if e.name is None or not e.name.startswith(COMPILER_PACKAGES):
                raise
            click.echo(f"error: {ctx.invoked_subcommand}: needs the compiler packages ({e.name} is not installed); "
                       "running a bundle needs iree-base-runtime alone", err=True)
            sys.exit(1)


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


@click.group(cls=_Group)
@click.version_option(package_name="k3c")
def main():
    """k3c: compile Kimi K3 / Kimi Linear checkpoints with IREE, run them, validate against PyTorch."""


FORCE = click.option("--force", is_flag=True,
                     help="Replace the output directory if k3c wrote it before (a directory k3c did not "
                          "write is never replaced).")


def gigabytes(ctx, param, value: float | None) -> float | None:
    """A memory size in GB: finite, above 0 and at most 10**6 (a petabyte), so that its bytes are
    an exact int (nan and inf pass click's FloatRange)."""
    if value is not None and not (math.isfinite(value) and 0 < value <= 1e6):
        raise K3Error(f"{param.opts[0]} {value}: give a size in GB above 0 and at most 1e6")
    return value


def utf8_text(ctx, param, value):
    """Text from the command line (click decodes argv with surrogate escapes): K3Error unless it
    is valid UTF-8, so that no tokenizer sees a lone surrogate."""
    for text in value if isinstance(value, tuple) else (value,):
        if text is not None and not _is_utf8(text):
            raise K3Error(f"{param.opts[0]}: not valid UTF-8 text")
    return value


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def load_config(preset: str | None, config: str | None):
    from .model.config import K3Config
    if config:
        cfg = K3Config.from_hf(config)
        if cfg.ignored_keys:
            click.echo(f"note: config: ignored keys k3c does not know (outside the model's math): "
                       f"{', '.join(cfg.ignored_keys)}", err=True)
        return cfg
    return K3Config.preset(preset or "k3-tiny")


@main.command()
@click.option("--preset", default=None, help="k3, k3-small or k3-tiny (default k3-tiny).")
@click.option("--config", "config_dir", default=None, type=click.Path(), help="Checkpoint dir or config.json.")
@click.option("--context", default=1_048_576, show_default=True, type=click.IntRange(min=1),
              help="Context length for cache sizes and attention FLOPs.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.option("--devices", default=None, type=click.IntRange(min=1),
              help="Also the bytes per device with the routed experts split over N devices.")
@click.option("--device-memory", default=None, type=float, callback=gigabytes, metavar="GB",
              help="With --devices: memory per device in GB (say whether the split fits).")
def inspect(preset, config_dir, context, as_json, devices, device_memory):
    """Parameters, bytes, state and cache sizes, FLOPs per token, from shapes on the meta device;
    when --config is a checkpoint directory, parameters and bytes as its safetensors headers store
    them. Writes nothing."""
    from .model.accounting import account, render
    from .model.checkpoint import INDEX_FILE, SINGLE_FILE
    checkpoint = Path(config_dir) if config_dir and any(
        (Path(config_dir) / f).is_file() for f in (INDEX_FILE, SINGLE_FILE)) else None
    cfg = load_config(preset, config_dir)
    figures = account(cfg, context, checkpoint)
    if devices:
        from .model.placement import placement_report
        figures["devices"] = placement_report(figures, cfg.num_experts, devices, device_memory)
    click.echo(json.dumps(figures, indent=2) if as_json else render(figures))
    if devices and not as_json:
        from .model.placement import render_devices
        click.echo(render_devices(figures["devices"]))


@main.command("balance-demo")
@click.option("--steps", default=3, show_default=True, type=click.IntRange(min=1), help="Bias updates.")
@click.option("--tokens", default=16384, show_default=True, type=click.IntRange(min=56),
              help="Tokens per batch (>= 56: a target load of at least one token per expert).")
@click.option("--seed", default=0, show_default=True, help="Seed of the synthetic router and its batches.")
def balance_demo(steps, tokens, seed):
    """Quantile Balancing against the sign rule at gamma 1e-4 ... 1e-1 (docs/model.md §4), on a synthetic
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


@main.command("init-checkpoint")
@click.option("--preset", required=True, help="k3, k3-small or k3-tiny.")
@click.option("--seed", default=0, show_default=True, help="Seed of the random weights.")
@click.option("--shard-size", default=None, callback=parse_size, help="Shard the weights, e.g. 2GB.")
@click.argument("out_dir", type=click.Path(file_okay=False))
@FORCE
def init_checkpoint(preset, seed, shard_size, out_dir, force):
    """Write a checkpoint of seeded random weights for a preset (same seed, same bytes)."""
    from .interface.checkpoints import init_checkpoint as write
    write(preset, seed, out_dir, shard_size, force=force, log=lambda line: click.echo(line, err=True))


@main.command()
@click.argument("in_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--show", default=20, show_default=True, help="Tensors listed, largest error first.")
@FORCE
def quantize(in_dir, out_dir, show, force):
    """Convert a checkpoint's float routed experts to MXFP4; other tensors are kept byte for byte."""
    from rich.console import Console
    from .interface.checkpoints import quantize as convert
    from .interface.tables import quantization_table
    report = convert(in_dir, out_dir, force=force, log=lambda line: click.echo(line, err=True))
    if report:
        Console().print(quantization_table(report, show))


def log(message: str) -> None:
    """Progress lines on stderr, with the time since the command started (above the spinner, whose
    clock restarts, while one runs)."""
    line = f"[{time.perf_counter() - _START:6.1f}s] {message}"
    if not _SPINNER:
        click.echo(line, err=True)
    for bar, task in _SPINNER:
        bar.console.print(line, markup=False, highlight=False, soft_wrap=True)
        bar.reset(task)


_START = time.perf_counter()
_SPINNER: list = []  # (rich Progress, task) while a long command runs on a terminal


@contextlib.contextmanager
def spinner(what: str):
    """On a terminal, a rich spinner under the log lines with the time the current step has run
    (since the last line), so a long silent step (export, iree-compile) shows it is alive. Elsewhere
    (pipes, CI) only the log lines are written."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    console = Console(stderr=True)
    if not console.is_terminal:
        yield
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        _SPINNER.append((bar, bar.add_task(what, total=None)))
        try:
            yield
        finally:
            _SPINNER.clear()


def source_options(f):
    f = click.option("--checkpoint", type=click.Path(file_okay=False), default=None,
                     help="HF checkpoint directory (config.json + safetensors).")(f)
    f = click.option("--preset", default=None, help="Built-in preset with seeded random weights (k3-tiny, k3-small).")(f)
    f = click.option("--seed", default=0, show_default=True, help="Seed of a preset's random weights.")(f)
    f = click.option("--max-prompt", default=DEFAULT_MAX_PROMPT, show_default=True, type=click.IntRange(min=2),
                     help="Longest prompt one prefill call takes (longer ones run in pieces through extend).")(f)
    return f


DEVICES = click.option("--devices", default=1, show_default=True, type=click.IntRange(min=1),
                       help="Devices of the target's driver one program runs on: the routed experts split "
                            "over them, the rest on the first (README, \"Past one device\").")


def pool_options(f):
    f = click.option("--slot-context", default=None, type=click.IntRange(min=2),
                     help="Tokens each sequence of the pool holds (with --max-batch; default the model's "
                          "max_position_embeddings).")(f)
    f = click.option("--max-batch", default=None, type=click.IntRange(min=1),
                     help="For k3c serve: a pool of this many sequences on the device and decode steps over "
                          "1, 2, 4 ... up to all of them at once (docs/usage.md §5).")(f)
    return f


def _pool(max_batch, slot_context, preset, checkpoint):
    """The sequence pool the pool options ask for (None without --max-batch)."""
    if max_batch is None:
        if slot_context:
            raise K3Error("compile: --slot-context sizes the pool of --max-batch; give --max-batch")
        return None
    from .exporter.entry_points import Pool
    from .model.config import K3Config
    cfg = K3Config.from_hf(checkpoint) if checkpoint else K3Config.preset(preset or "k3-tiny")
    return Pool(context=slot_context or cfg.max_position_embeddings, max_batch=max_batch)


def _target(spec: str, devices: int):
    """``--target`` over ``--devices`` (a K3Error for a bad one, before any slow import)."""
    from .compiler.targets import on_devices, parse_target
    return on_devices(parse_target(spec), devices)


def _out_name(name: str, tgt) -> str:
    return f"{name}-{tgt.name.replace(':', '-')}" + (f"-x{tgt.devices}" if tgt.devices > 1 else "")


def one_source(preset, checkpoint):
    if preset and checkpoint:
        raise K3Error("give either --preset or --checkpoint, not both")
    return (preset or (None if checkpoint else "k3-tiny")), checkpoint


@main.command()
@source_options
@click.option("--format", "fmt", type=click.Choice(["mlir", "onnx"]), default="mlir", show_default=True,
              help="mlir: torch.mlir (before passes) and lowered.mlir (after); onnx: prefill.onnx and "
                   "decode.onnx (k3 custom ops as nodes of the domain k3), checkpoint/ and k3c-onnx.json.")
@click.option("-o", "--output", type=click.Path(file_okay=False), default=None, help="Output directory.")
@click.option("--emit-mlir", type=click.Path(file_okay=False), default=None,
              help="Same as --format mlir -o DIR.")
@click.option("--config", "config_dir", type=click.Path(), default=None,
              help="Export for the config.json in this directory (no weights needed).")
@click.option("--target", default="cpu", show_default=True, help="Whose passes lowered.mlir shows (--format mlir).")
@DEVICES
@FORCE
def export(preset, checkpoint, seed, max_prompt, fmt, output, emit_mlir, config_dir, target, devices, force):
    """Export prefill/decode: to torch-dialect MLIR, running the passes (--format mlir), or to ONNX with
    the weights as external data in the checkpoint written beside the models (--format onnx)."""
    preset, checkpoint = one_source(preset, checkpoint)
    if emit_mlir and (output or fmt == "onnx"):
        raise K3Error("export: --emit-mlir DIR stands for --format mlir -o DIR; give one of them")
    out = output or emit_mlir
    if not out:
        raise K3Error("export: give the output directory with -o OUT_DIR")
    from .utils.files import check_output
    check_output(out, force=force, inputs=(checkpoint,))
    if fmt == "onnx":
        if devices > 1:
            raise K3Error("export: --devices takes --format mlir (the ONNX programs run on one device)")
        from .exporter.onnx_export import export_onnx
        export_onnx(Path(out), preset=preset, checkpoint=Path(checkpoint) if checkpoint else None, seed=seed,
                    max_prompt=max_prompt, log=log)
        return
    tgt = _target(target, devices)
    from .artifacts.bundle import stored_dtypes
    from .interface.build import export_mlir
    cfg = load_config(None if config_dir else preset, config_dir or checkpoint)
    dtypes = stored_dtypes(Path(checkpoint)) if checkpoint else None
    with spinner("export: current step"):
        export_mlir(Path(out), cfg, tgt, dtypes=dtypes, max_prompt=max_prompt, force=force, log=log)


@main.command("compile")
@source_options
@click.option("--target", default="cpu", show_default=True, help="cpu (this CPU), cpu:x86-64, cpu:x86-64-v3 (AVX2), cpu:x86-64-v4 (AVX-512), cuda[:sm_XX], rocm[:gfxXXX], vulkan[:profile].")
@click.option("-o", "--output", type=click.Path(file_okay=False), default=None, help="Bundle directory (default out/<name>-<target>).")
@click.option("--onnx", "onnx_dir", type=click.Path(file_okay=False), default=None,
              help="Compile an ONNX export directory (k3c export --format onnx) instead of --preset/--checkpoint; "
                   "its weights and max prompt come with it.")
@click.option("--config", "config_dir", type=click.Path(), default=None,
              help="Compile for the config.json in this directory (with --no-weights).")
@click.option("--no-weights", is_flag=True,
              help="Write the module and manifest only: no checkpoint, packed weights or reference outputs "
                   "(built from shapes on the meta device; the way to compile the full k3). k3c attach "
                   "gives it the weights of any checkpoint of that config.")
@DEVICES
@pool_options
@FORCE
def compile_cmd(preset, checkpoint, seed, max_prompt, target, output, onnx_dir, config_dir, no_weights, devices,
                max_batch, slot_context, force):
    """Compile a checkpoint or preset for a target; writes a bundle (manifest, module, packed weights,
    checkpoint, reference.npz). The model is compiled from shapes and the weights packed one tensor at
    a time, so a checkpoint larger than memory compiles too (without reference outputs). The default
    output out/<name>-<target> is replaced without --force; a directory given with -o needs it."""
    if no_weights or config_dir:
        if onnx_dir or not no_weights:
            raise K3Error("compile: --config takes --no-weights (a config has no weights), and --onnx does not")
        tgt = _target(target, devices)
        from .interface.build import build_module_only
        cfg = load_config(None if config_dir else preset, config_dir or checkpoint)
        pool = _pool(max_batch, slot_context, None if config_dir else preset, config_dir or checkpoint)
        name = Path(config_dir or checkpoint or "").name or preset or "k3-tiny"
        out = Path(output) if output else Path("out") / f"{_out_name(name, tgt)}-module"
        with spinner("compile: current step"):
            click.echo(str(build_module_only(out, cfg, tgt, max_prompt=max_prompt, pool=pool,
                                             force=force or not output, log=log)))
        return
    if onnx_dir and max_batch:
        raise K3Error("compile: --max-batch takes --preset or --checkpoint (the ONNX programs have no pool)")
    pool = None if onnx_dir else _pool(max_batch, slot_context, *one_source(preset, checkpoint))
    with spinner("compile: current step"):
        bundle = _build(preset, checkpoint, seed, max_prompt, target, output, onnx_dir, force, devices, pool)
    click.echo(str(bundle.root))


@main.command()
@click.argument("module_dir", type=click.Path(file_okay=False))
@click.option("--checkpoint", required=True, type=click.Path(file_okay=False),
              help="The checkpoint (any layout k3c reads: its own, the K3 release, Kimi Linear).")
@click.option("--weights", type=click.Path(dir_okay=False), default=None,
              help="An archive k3c pack made of that checkpoint: the bundle names it by path instead "
                   "of packing the checkpoint again.")
@click.option("-o", "--output", type=click.Path(file_okay=False), default=None,
              help="Bundle directory (default out/<checkpoint>-<target>).")
@FORCE
def attach(module_dir, checkpoint, weights, output, force):
    """Make a bundle of a module compiled with --no-weights and a checkpoint of its config, without
    compiling again: the weights packed (or --weights), the tokenizer, reference outputs when the
    model fits in memory. Any mismatch is one error line before anything is written."""
    from .interface.build import attach_weights
    with spinner("attach: current step"):
        bundle = attach_weights(Path(module_dir), Path(checkpoint), Path(output) if output else None,
                                weights=Path(weights) if weights else None, force=force, log=log)
    click.echo(str(bundle.root))


@main.command()
@click.argument("checkpoint", type=click.Path(file_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="The .irpa archive to write.")
def pack(checkpoint, output):
    """Write a checkpoint's weights as an IREE parameter archive in the compiled program's layout
    (each tensor kind stacked over its layers, experts stacked), streaming one tensor at a time,
    from any layout k3c reads. The archive describes itself (config, checkpoint hash, each
    parameter's dtype, shape and sha256); k3c attach MODULE --checkpoint DIR --weights ARCHIVE uses it."""
    from .artifacts.pack import pack as pack_archive
    from .model.checkpoint import checkpoint_dir
    if Path(output).exists():
        raise K3Error(f"pack: {output} exists; k3c does not replace a file it did not just write")
    pack_archive(checkpoint_dir(checkpoint), Path(output), log=log)


def _build(preset, checkpoint, seed, max_prompt, target, output, onnx_dir=None, force=False, devices=1, pool=None):
    if onnx_dir and (preset or checkpoint):
        raise K3Error("compile: --onnx brings its own weights; drop --preset/--checkpoint")
    if onnx_dir and devices > 1:
        raise K3Error("compile: --devices takes --preset or --checkpoint (an ONNX program runs on one device)")
    preset, checkpoint = (None, None) if onnx_dir else one_source(preset, checkpoint)
    tgt = _target(target, devices)  # before the slow imports below: a bad --target fails at once
    from .interface.build import build_bundle, build_bundle_from_onnx
    if tgt.note:
        log(f"warning: {tgt.note}")
    name = Path(onnx_dir).name if onnx_dir else preset or Path(checkpoint).name
    out = Path(output) if output else Path("out") / _out_name(name, tgt)
    force = force or not output  # k3c's own default location
    if onnx_dir:
        return build_bundle_from_onnx(out, tgt, Path(onnx_dir), force=force, log=log)
    return build_bundle(out, tgt, preset=preset, checkpoint=Path(checkpoint) if checkpoint else None,
                        seed=seed, max_prompt=max_prompt, pool=pool, force=force, log=log)


def parse_ids(ctx, param, value: str | None) -> list[int] | None:
    """'1,2,3' -> [1, 2, 3]; an empty item or anything but an integer that fits int64 is a K3Error
    naming the first bad item."""
    if value is None:
        return None
    items = [x.strip() for x in value.split(",")]
    bad = next((x for x in items if not re.fullmatch(r"[+-]?\d{1,19}", x) or not -2**63 <= int(x) < 2**63), None)
    if bad == "":
        raise K3Error(f"--prompt-ids: empty item in {value!r} (give e.g. 1,2,3)")
    if bad is not None:
        raise K3Error(f"--prompt-ids: {bad!r} is not a token id (an integer; give e.g. 1,2,3)")
    return [int(x) for x in items]


def generation_options(default_tokens: int):
    def add(f):
        for option in reversed([
            click.option("-n", "--max-new-tokens", "max_new_tokens", default=default_tokens, show_default=True,
                         type=click.IntRange(min=1), help="Most tokens to generate (per turn)."),
            click.option("--temperature", default=0.0, show_default=True, type=float,
                         help="0 is greedy; above 0 samples from softmax(logits / temperature)."),
            click.option("--top-k", default=0, show_default=True, type=int, help="Sample among the k most likely (0: all)."),
            click.option("--top-p", default=1.0, show_default=True, type=float,
                         help="Sample among the most likely tokens whose mass reaches p (1: all)."),
            click.option("--seed", default=0, show_default=True, type=int, help="Seed of the sampler."),
            click.option("--stop", multiple=True, callback=utf8_text, help="Stop when the text contains STRING (repeatable)."),
        ]):
            f = option(f)
        return f
    return add


def _open_for_text(bundle, temperature, top_k, top_p, seed):
    from .artifacts.bundle import open_bundle
    from .runtimes.sampling import Sampler
    from .runtimes.session import Session
    sampler = Sampler(temperature, top_k, top_p, seed)  # bad values fail before the module loads
    return Session(open_bundle(bundle)), sampler


def _write(text: str) -> None:
    """Generated text as is (click.echo would drop escape sequences when stdout is not a terminal)."""
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def _report(gen, session) -> None:
    """The throughput line on stderr, after a note when the context ran full."""
    if gen.finish_reason == "context":
        click.echo(f"stopped at the context limit: {session.max_context} tokens (prompt and generated)", err=True)
    decode = f": {gen.decode_tok_s:.1f} tok/s" if gen.decode_s else ""
    click.echo(f"prefill {gen.n_prompt} tokens: {gen.prefill_s * 1e3:.1f} ms ({gen.prefill_tok_s:.1f} tok/s); "
               f"decode {len(gen.decode_s)} tokens{decode}", err=True)


@main.command()
@click.argument("bundle", type=click.Path(file_okay=False))
@click.option("--prompt", default=None, callback=utf8_text, help="Prompt text, encoded with the bundle's tokenizer.")
@click.option("--prompt-ids", callback=parse_ids, default=None,
              help="Comma-separated token ids, e.g. 1,2,3 (prints ids instead of text; EOS does not stop "
                   "it: it runs to --max-new-tokens).")
@click.option("--chat", is_flag=True, help="Render --prompt as a user turn with the checkpoint's chat template.")
@click.option("--system", default=None, callback=utf8_text, help="System message for --chat.")
@generation_options(16)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: text, ids, timings, finish reason.")
def run(bundle, prompt, prompt_ids, chat, system, max_new_tokens, temperature, top_k, top_p, seed, stop, as_json):
    """Generate with a compiled bundle: the text streams to stdout as it is produced, then one line
    of prefill and decode throughput on stderr. Greedy unless --temperature is above 0."""
    from .runtimes.chat import encode_prompt, generate_text
    from .runtimes.tokenizer import bundle_tokenizer
    if (prompt is None) == (prompt_ids is None):
        raise K3Error("run: give exactly one of --prompt TEXT and --prompt-ids IDS")
    if (chat or system or stop) and prompt is None:
        raise K3Error("run: --chat, --system and --stop take a --prompt TEXT")
    session, sampler = _open_for_text(bundle, temperature, top_k, top_p, seed)
    if prompt_ids is not None:
        if not prompt_ids:
            raise K3Error("run: --prompt-ids is empty")
        gen = session.generate(prompt_ids, max_new_tokens, sampler, stop_ids=())
        text = None
        if not as_json:
            click.echo(",".join(map(str, gen.ids)))
    else:
        tokenizer = bundle_tokenizer(session.bundle)
        prompt_ids = encode_prompt(tokenizer, prompt, chat or bool(system), system, session.max_context)
        text, gen = generate_text(session, tokenizer, prompt_ids, max_new_tokens=max_new_tokens, sampler=sampler,
                                  stops=stop, write=(lambda _: None) if as_json else _write)
        if not as_json:
            click.echo()
    if as_json:
        click.echo(json.dumps({"text": text, "ids": gen.ids, "prompt_ids": [int(i) for i in prompt_ids],
                               "finish_reason": gen.finish_reason, "prefill_s": gen.prefill_s,
                               "prefill_tok_s": gen.prefill_tok_s, "decode_s": sum(gen.decode_s),
                               "decode_tok_s": gen.decode_tok_s}))
    _report(gen, session)


@main.command()
@click.argument("bundle", type=click.Path(file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback unless told).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--api-key", default=None, envvar="K3C_API_KEY",
              help="Answer /v1/ requests only with 'Authorization: Bearer KEY' (or $K3C_API_KEY).")
@click.option("--model", "model_name", default=None, help="The model name clients use (default: the bundle's directory name).")
@click.option("--max-active", default=None, type=click.IntRange(1),
              help="Sequences in flight at once (default: the bundle's --max-batch, else 8).")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(0),
              help="Requests that may wait for a place; more get 429.")
def serve(bundle, host, port, api_key, model_name, max_active, max_queue):
    """Serve a bundle over OpenAI's HTTP API: /v1/chat/completions, /v1/completions, /v1/models,
    /health and /metrics."""
    from .interface.serve import serve as serve_bundle
    serve_bundle(bundle, host, port, api_key, model_name, max_active, max_queue, log=lambda m: click.echo(m, err=True))


@main.command()
@click.argument("bundle", type=click.Path(file_okay=False))
@click.option("--system", default=None, callback=utf8_text, help="System message.")
@generation_options(256)
def chat(bundle, system, max_new_tokens, temperature, top_k, top_p, seed, stop):
    """Interactive chat: one user turn per line of stdin (an empty line or end of input ends it).
    The state stays on the device between turns and only the new turn is prefilled."""
    from .runtimes.chat import Conversation, read_turn
    from .runtimes.tokenizer import bundle_tokenizer
    session, sampler = _open_for_text(bundle, temperature, top_k, top_p, seed)
    tokenizer = bundle_tokenizer(session.bundle)
    conversation = Conversation(session, tokenizer, system)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            click.echo("> ", nl=False, err=True)
        line = read_turn(sys.stdin.buffer, tokenizer, session.max_context)
        if not line.strip():
            return
        _, gen = conversation.turn(line.rstrip("\n"), max_new_tokens=max_new_tokens, sampler=sampler, stops=stop,
                                   write=_write)
        click.echo()
        _report(gen, session)


@main.command()
@click.argument("bundle", type=click.Path(file_okay=False), required=False)
@source_options
@click.option("--target", default="cpu", show_default=True, help="Target when building from --preset/--checkpoint.")
@click.option("-o", "--output", type=click.Path(file_okay=False), default=None, help="Where to write the bundle it builds.")
@click.option("--per-layer", is_flag=True, help="Also compare the residual stream after every layer.")
@click.option("--layers", "by_layer", is_flag=True,
              help="Check every layer on its own (no whole-model reference needed; memory of one layer): its "
                   "compiled entry point against the eager layer on that layer's weights from the checkpoint "
                   "(with BUNDLE, --checkpoint names another checkpoint of the same config to read them from).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Write the results as JSON.")
@FORCE
def validate(bundle, preset, checkpoint, seed, max_prompt, target, output, per_layer, by_layer, json_out, force):
    """Compare a bundle (or one built now from --preset/--checkpoint) against its PyTorch reference:
    per step max abs/rel error, cosine, top-1/top-5 agreement; with --layers, per layer max abs/rel
    error; exit 1 on FAIL."""
    from rich.console import Console
    from .artifacts.bundle import open_bundle
    from .utils.files import write_atomic
    from .interface.tables import residual_table, steps_table
    from .interface.validate import TOLERANCE, as_dicts, first_divergent, first_non_finite, validate as run_validation
    if by_layer:
        if per_layer:
            raise K3Error("validate: give either --layers or --per-layer, not both")
        return _validate_layers(bundle, preset, checkpoint, seed, max_prompt, target, output, json_out, force)
    with spinner("validate: current step"):
        b = open_bundle(bundle) if bundle else _build(preset, checkpoint, seed, max_prompt, target, output, force=force)
        tol = TOLERANCE[b.manifest.target["backend"]]
        steps, layers = run_validation(b, per_layer)
    Console().print(steps_table(b, steps, tol))
    if non_finite := first_non_finite(steps):
        click.echo(non_finite)
    if per_layer:
        Console().print(residual_table(layers))
        bad = first_divergent(layers, tol)
        click.echo(f"first divergent layer: {bad.layer} ({bad.kind})" if bad else "no layer diverges")
    if json_out:
        write_atomic(Path(json_out), json.dumps({"bundle": str(b.root), "target": b.manifest.target["name"],
                                                 "tolerance": tol, "steps": as_dicts(steps),
                                                 "layers": as_dicts(layers)}, indent=2).encode())
    ok = all(s.passed for s in steps)
    click.echo("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


def _validate_layers(bundle, preset, checkpoint, seed, max_prompt, target, output, json_out, force):
    """``k3c validate --layers`` (interface/validate_layers.py): a table of every layer, exit 1 on FAIL."""
    from rich.console import Console
    from .artifacts.bundle import open_bundle
    from .utils.files import write_atomic
    from .interface.tables import layer_checks_table
    from .interface.validate import TOLERANCE, as_dicts
    from .interface.validate_layers import validate_layers
    with spinner("validate --layers: current layer"):
        if bundle:
            b, against = open_bundle(bundle), checkpoint
        else:
            b, against = _build(preset, checkpoint, seed, max_prompt, target, output, force=force), None
        checks, peak = validate_layers(b, Path(against) if against else None, log=log)
    tol = TOLERANCE[b.manifest.target["backend"]]
    Console().print(layer_checks_table(b, checks, tol))
    click.echo(f"peak RSS {peak / 2**20:.0f} MiB")
    if json_out:
        write_atomic(Path(json_out), json.dumps({"bundle": str(b.root), "target": b.manifest.target["name"],
                                                 "tolerance": tol, "peak_rss": peak, "layers": as_dicts(checks)},
                                                indent=2).encode())
    bad = next((c for c in checks if not c.passed), None)
    click.echo("PASS" if bad is None else f"FAIL (first at layer {bad.layer}, {bad.kind})")
    sys.exit(0 if bad is None else 1)


@main.command()
@click.option("--validate", "validate_preset", default=None, metavar="PRESET",
              help="Also build a PRESET bundle (e.g. k3-tiny) for each target that runs here and validate it.")
@click.option("--markdown", is_flag=True, help="Print a Markdown table (the README's).")
@click.option("--work", type=click.Path(file_okay=False), default="out/targets", show_default=True,
              help="Where --validate writes its bundles.")
def targets(validate_preset, markdown, work):
    """What --target accepts: per target, whether this host compiles for it (a probe compile), runs it
    (driver and a matching device present), and the device found; with --validate, the validation
    result of each target that runs here."""
    from rich.console import Console
    from .compiler.targets import target_statuses
    from .interface.tables import markdown_table, target_cells, targets_table
    if validate_preset:
        from .model import K3Config
        from .interface.validate import validate_targets
        K3Config.preset(validate_preset)  # an unknown preset fails before any compile
        with spinner("targets: validating"):
            rows = validate_targets(validate_preset, Path(work), log=log)
    else:
        rows = target_statuses()
    columns, cells = target_cells(rows, validate_preset)
    if markdown:
        click.echo(markdown_table(columns, cells))
        return
    Console().print(targets_table(columns, cells))


@main.command()
@click.option("--quick", is_flag=True, help="k3-tiny and toy sizes, no hybrid or compile sections (a smoke run).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Write the results as JSON.")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), default=None, help="Write a PNG plot.")
@click.option("--only", multiple=True, type=click.Choice(BENCH_SECTIONS),
              help="Run only these sections (repeatable; default all).")
@click.option("--work", type=click.Path(file_okay=False), default="out/bench", show_default=True,
              help="Directory for the checkpoints, bundles and MLIR it builds (reused across runs).")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(min=1),
              help="Threads for PyTorch and for IREE's workers alike.")
@click.option("--target", default="cpu", show_default=True,
              help="CPU target of the compiled side: cpu (this CPU) or a CPU level this CPU runs "
                   "(cpu:x86-64, cpu:x86-64-v3, cpu:x86-64-v4; k3c targets).")
@click.option("--compile-layers", default=None, metavar="N,N,...",
              help="Depths of the compile section at k3-small widths (default 8,32,93; the section then "
                   "compiles the full K3 for cpu and cuda:sm_80: about an hour on 2 cores).")
@click.option("--markdown", "page_out", type=click.Path(dir_okay=False), default=None,
              help="Write the benchmarks page (docs/benchmarks.md): of the RUNS given (JSON written by --json; "
                   "nothing is measured then), else of this run.")
@click.argument("runs", nargs=-1, type=click.Path(dir_okay=False))
def bench(quick, json_out, plot_out, only, work, threads, target, compile_layers, page_out, runs):
    """Compiled CPU modules vs PyTorch eager, and compiler costs; every judged figure is a ratio of
    measurements interleaved in this run. Prints a Markdown table of the targets; exit 0 even on misses.
    With RUNS and --markdown, only writes the page of those runs."""
    import dataclasses
    import shlex
    from .compiler.targets import parse_target
    from .interface.bench import FULL, QUICK, run_bench
    from .utils.files import write_atomic
    from .interface.bench_report import markdown, page, plot, read_runs, targets
    command = "k3c " + shlex.join(sys.argv[1:])
    if runs:
        if not page_out:
            raise K3Error("bench: RUNS are rendered with --markdown PAGE (they are JSON files from --json)")
        write_atomic(Path(page_out), page(read_runs(runs, Path(page_out).parent), command, Path(page_out)).encode())
        return
    sizes = QUICK if quick else FULL
    if compile_layers:
        depths = [int(x) for x in compile_layers.split(",") if x.strip().isdigit()]
        if len(depths) != len(compile_layers.split(",")) or len(depths) < 2 or min(depths) < 1 \
                or depths != sorted(set(depths)):
            raise K3Error(f"--compile-layers: give two or more increasing depths, e.g. 4,8 (got {compile_layers})")
        sizes = dataclasses.replace(sizes, compile_layers=tuple(depths))
    tgt = parse_target(target)
    if tgt.backend != "llvm-cpu":
        raise K3Error(f"bench: --target {target}: the bench compares compiled CPU modules with PyTorch on this "
                      f"CPU; give cpu or cpu:<level>")
    with spinner("bench: current step"):
        result = run_bench(sizes, Path(work), only, target=target, threads=threads, log=log)
    result["targets"] = targets(result["sections"])
    result["command"] = command
    if json_out:
        write_atomic(Path(json_out), json.dumps(result, indent=2).encode())
    if plot_out:
        plot(result, Path(plot_out))
    if page_out:
        name = os.path.relpath(json_out, Path(page_out).parent) if json_out else "not saved"
        write_atomic(Path(page_out), page([(name, result)], command, Path(page_out)).encode())
    click.echo(markdown(result))

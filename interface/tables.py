"""The tables the verbs print (rich): what each result looks like on a terminal. The CLI calls
these and prints; the results themselves come from the other interface modules."""
from __future__ import annotations

from rich.table import Table

YES_NO = {True: "yes", False: "no"}
FAIL = "[red]FAIL[/red]"


def quantization_table(report, show: int) -> Table:
    """``k3c quantize``: the ``show`` tensors of largest relative RMS error, and the mean and max."""
    table = Table(title="MXFP4 relative RMS error ||W_q - W|| / ||W||")
    table.add_column("tensor")
    table.add_column("shape")
    table.add_column("rel. RMS error", justify="right")
    for q in sorted(report, key=lambda q: (-q.rel_rms_error, q.name))[:show]:
        table.add_row(q.name, "x".join(map(str, q.shape)), f"{q.rel_rms_error:.4f}")
    errors = [q.rel_rms_error for q in report]
    table.caption = (f"{len(report)} tensors (largest {min(show, len(report))} shown): "
                     f"mean {sum(errors) / len(errors):.4f}, max {max(errors):.4f}")
    return table


def steps_table(bundle, steps, tol: float) -> Table:
    """``k3c validate``: per step the errors against PyTorch and the verdict."""
    table = Table(title=f"{bundle.root.name}: {bundle.manifest.target['name']} vs PyTorch (tolerance {tol:g} max abs)")
    for col in ("step", "max abs", "max rel", "cosine", "top-1", "top-5", "result"):
        table.add_column(col, justify="left" if col == "step" else "right")
    for s in steps:
        table.add_row(s.step, f"{s.max_abs:.2e}", f"{s.max_rel:.2e}", f"{s.cosine:.8f}", f"{s.top1:.3f}",
                      f"{s.top5:.3f}", "PASS" if s.passed else FAIL)
    return table


def residual_table(layers) -> Table:
    """``k3c validate --per-layer``: the residual stream's error after each layer."""
    table = Table(title="residual stream after each layer (prefill)")
    for col in ("layer", "kind", "max abs", "max rel"):
        table.add_column(col, justify="right")
    for lr in layers:
        table.add_row(str(lr.layer), lr.kind, f"{lr.max_abs:.2e}", f"{lr.max_rel:.2e}")
    return table


def layer_checks_table(bundle, checks, tol: float) -> Table:
    """``k3c validate --layers``: each layer's compiled entry point against the eager layer."""
    table = Table(title=f"{bundle.root.name}: each layer on {bundle.manifest.target['name']} vs PyTorch on its own "
                        f"weights (tolerance {tol:g} max abs)")
    for col in ("layer", "kind", "max abs", "max rel", "result"):
        table.add_column(col, justify="right")
    for c in checks:
        table.add_row(str(c.layer), c.kind, f"{c.max_abs:.2e}", f"{c.max_rel:.2e}",
                      "PASS" if c.passed else FAIL if c.finite else "[red]FAIL (non-finite)[/red]")
    return table


def target_cells(rows, validated_preset: str | None) -> tuple[list[str], list[list[str]]]:
    """``k3c targets``: the column names and the cells of each target's row."""
    columns = ["target", "driver", "compiles here", "runs here", "device found"]
    if validated_preset:
        columns += [f"{validated_preset} validated", "worst max abs", "tolerance"]
    cells = [[r.target.name, r.target.driver, YES_NO[r.compiles], YES_NO[r.runs], r.device] + (
        [r.validated, "-" if r.max_abs is None else f"{r.max_abs:.1e}", f"{r.tolerance:g}"]
        if validated_preset else []) for r in rows]
    return columns, cells


def markdown_table(columns: list[str], cells: list[list[str]]) -> str:
    return "\n".join("| " + " | ".join(line) + " |" for line in [columns, ["---"] * len(columns), *cells])


def targets_table(columns: list[str], cells: list[list[str]]) -> Table:
    table = Table(title="k3c targets")
    for c in columns:
        table.add_column(c, no_wrap=c != "device found")
    for line in cells:
        table.add_row(*line)
    return table

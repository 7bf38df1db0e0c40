"""The tensor tables Kimi K3 and Kimi-Linear-48B were released with (../shared/real/*/tensors.md,
beside the repository): every stored tensor, by name, shape and dtype, expanded from the table's
compressed rows, is what k3c's checkpoint reader accepts for the released config.json, and exactly
the tensors the model of that config needs. The headers are built from the table (no weights are
reachable), then read by the same code that reads real safetensors headers."""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from k3c.errors import K3Error
from k3c.interface.build import meta_model
from k3c.model.accounting import published_dtype
from k3c.model.checkpoint import (DTYPE_NAMES, TORCH_DTYPES, Checkpoint, _text_tensors, check_entries,
                                  stored_entries)
from k3c.model.config import K3Config
from k3c.model.stacking import to_checkpoint

REAL = Path(__file__).resolve().parents[1].parent / "shared" / "real"
pytestmark = pytest.mark.skipif(not REAL.is_dir(), reason=f"no released tensor tables at {REAL}")

ROW = re.compile(r"^\| `(?P<name>[^`]+)`(?: \((?P<counts>[^)]*)\))? \| `\[(?P<shape>[\d, ]*)\]` \| "
                 r"`torch\.(?P<dtype>\w+)` \| [^|]+ \| (?P<file>[^|]+) \|$")
# a range list in a name: "0-92", "3,7,...,83,87,91-92" (an ellipsis continues the step before it)
RANGES = re.compile(r"(?<=\.)(?P<list>(?:\d+(?:-\d+)?|\.\.\.)(?:,(?:\d+(?:-\d+)?|\.\.\.))+|\d+-\d+)(?=\.)")
SAFETENSORS = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "uint8": "U8"}


def expand_list(text: str) -> list[int]:
    """'0-2,4-6' -> [0, 1, 2, 4, 5, 6]; '3,7,...,87,91-92' -> 3, 7, 11, ..., 87, 91, 92."""
    out: list[int] = []
    items = text.split(",")
    for i, item in enumerate(items):
        if item == "...":
            step = out[-1] - out[-2]
            stop = int(items[i + 1].split("-")[0])
            out.extend(range(out[-1] + step, stop, step))
        else:
            lo, _, hi = item.partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def expand_name(pattern: str) -> list[str]:
    """Every tensor name a table row stands for (each range list expanded, outermost first)."""
    m = RANGES.search(pattern)
    if m is None:
        return [pattern]
    head, tail = pattern[:m.start()], pattern[m.end():]
    return [name for i in expand_list(m["list"]) for name in expand_name(f"{head}{i}{tail}")]


def read_table(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) of every tensor the table lists; each row's own count
    ("×69 layers, ×896 experts") is checked against its expansion."""
    header = {}
    for line in path.read_text().splitlines():
        m = ROW.match(line)
        if m is None:
            continue
        names = expand_name(m["name"])
        counts = [int(c) for c in re.findall(r"×(\d+)", m["counts"] or "")]
        assert len(names) == (torch.tensor(counts).prod().item() if counts else 1), line
        shape = tuple(int(d) for d in m["shape"].split(",")) if m["shape"] else ()
        header.update({name: (SAFETENSORS[m["dtype"]], shape) for name in names})
    return header


def stored_numbers(header) -> int:
    return sum(torch.Size(shape).numel() for _, shape in header.values())


@pytest.fixture(scope="module", params=[("kimi-k3", 497_220, 1_503_647_073_024),
                                        ("kimi-linear-48b-a3b-instruct", 20_493, 49_122_681_728)],
                ids=["kimi-k3", "kimi-linear-48b"])
def release(request):
    """(config, the table as one header, its reader's entries, the tensors the config's model needs)
    of a release; the table's totals are the report's (its header line)."""
    directory, tensors, numbers = request.param
    table = read_table(REAL / directory / "tensors.md")
    assert (len(table), stored_numbers(table)) == (tensors, numbers)
    cfg = K3Config.from_hf(REAL / directory)
    listing = Path("model.safetensors")    # the table as one file: the shard split is not published
    text, _ = _text_tensors(table)
    ckpt = Checkpoint(REAL / directory, listing, {listing: text}, stored_entries({listing: text}, {}, listing, cfg))
    return cfg, table, ckpt, to_checkpoint(meta_model(cfg).state_dict())


def test_the_table_is_exactly_the_model_of_the_config(release):
    """Every tensor the model needs is stored, with its shape and a dtype k3c reads, and nothing else
    (the vision tower and projector of K3's wrapper set aside)."""
    _, _, ckpt, expected = release
    check_entries(ckpt, expected)


def test_the_dtypes_k3c_compiles_for_without_weights_are_the_stored_ones(release):
    """``compile --no-weights`` assumes the release's dtypes (model/accounting.py published_dtype):
    the table says what they are."""
    cfg, _, ckpt, expected = release
    wrong = {name: (e.dtype, DTYPE_NAMES[published_dtype(cfg, name, expected[name])])
             for name, e in ckpt.entries.items()
             if TORCH_DTYPES[e.dtype] != published_dtype(cfg, name, expected[name])}
    assert wrong == {}


def test_vision_and_projector_tensors_are_all_that_is_set_aside(release):
    _, table, ckpt, _ = release
    (text,) = ckpt.stored.values()
    assert {name.split(".")[0] for name in table.keys() - text.keys()} <= {"vision_tower", "mm_projector"}


def test_a_shape_off_by_one_in_the_table_would_be_refused(release):
    """The check is not vacuous: one tensor of the table one row longer is refused, naming it."""
    _, _, ckpt, expected = release
    name = next(n for n in sorted(ckpt.entries) if n.endswith("o_proj.weight"))
    entry = ckpt.entries[name]
    entries = {**ckpt.entries, name: replace(entry, shape=(entry.shape[0] + 1, *entry.shape[1:]))}
    with pytest.raises(K3Error, match=re.escape(entry.key)):
        check_entries(replace(ckpt, entries=entries), expected)


@pytest.mark.slow   # exports the full model: about a minute for K3
def test_the_program_exported_from_the_config_reads_what_the_table_packs_into(release, k3c_cache, tmp_path,
                                                                              monkeypatch):
    """``k3c export --config`` of the released config.json (the front end of ``k3c compile
    --no-weights``: export and every custom-op pass, iree-compile aside) gives a module whose
    parameters are exactly what the released checkpoint, as its table lists it, packs into: names,
    dtypes and shapes (artifacts/pack.py ``checkpoint_table``)."""
    from iree.compiler import ir
    from click.testing import CliRunner

    from k3c.artifacts.pack import checkpoint_table
    from k3c.cli import main
    from k3c.interface.build import module_parameters

    cfg, _, ckpt, _ = release
    monkeypatch.setenv("K3C_CACHE", str(k3c_cache))
    r = CliRunner().invoke(main, ["export", "--config", str(ckpt.directory), "--target", "cpu:x86-64",
                                  "-o", str(tmp_path / "mlir")])
    assert r.exit_code == 0, r.output
    lowered = (tmp_path / "mlir" / "lowered.mlir").read_text()
    assert "torch.k3." not in lowered        # every custom op lowered
    module = ir.Module.parse(lowered, context=ir.Context())
    table = checkpoint_table(cfg, ckpt)
    assert len(table) > 30 and module_parameters(module) == table

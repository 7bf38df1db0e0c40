"""k3c.tools.layers: imports against the layer order are found (module level, inside functions,
relative and absolute), imports with the flow pass, and the real tree holds to the layout."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path


from k3c.tools import layers

ROOT = Path(layers.__file__).resolve().parent.parent


def package(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package directory (named anything: the checker calls it k3c) holding ``files``."""
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.parent != root:
            (path.parent / "__init__.py").touch()
        path.write_text(text)
    return root


def messages(root: Path) -> list[str]:
    return [f"{f.path.relative_to(root)}:{f.line}: {f.message}" for f in layers.check(root)]


def test_imports_with_the_flow_pass(tmp_path):
    root = package(tmp_path, {
        "errors.py": "class K3Error(Exception): ...\n",
        "utils/files.py": "from ..errors import K3Error\n",
        "model/config.py": "from ..errors import K3Error\nfrom ..utils.files import write_atomic\nfrom . import mxfp4\n",
        "model/mxfp4.py": "from .config import K3Config\n",           # a cycle inside a folder is no layer's business
        "passes/trace.py": "from ..exporter.export import x\nimport k3c.model.config\n",
        "exporter/export.py": "from k3c.model import K3Model\nfrom k3c import errors\n",
        "interface/build.py": "from ..compiler.targets import compile_mlir\nfrom ..artifacts import bundle\n",
        "cli.py": "from .interface import build\nfrom . import errors\n",
        "tools/layers.py": "from k3c import cli\n",
        "runtimes/session.py": "import numpy\nfrom iree import runtime\nfrom ..artifacts.bundle import Bundle\n",
    })
    assert messages(root) == []


def test_each_kind_of_import_against_the_flow_is_found(tmp_path):
    root = package(tmp_path, {
        "model/convert.py": "from ..artifacts.bundle import atomic_dir\n",                    # relative, module level
        "exporter/onnx.py": "def f():\n    import k3c.passes.onnx_ops\n",                      # absolute, in a function
        "artifacts/build.py": "class C:\n    def m(self):\n        from k3c.runtimes import targets\n",
        "compiler/targets.py": "from .. import cli\n",                                         # from-package names
        "errors.py": "from k3c.model.config import K3Config\n",
        "__init__.py": "from .model import K3Model\n",
    })
    assert sorted(messages(root)) == [
        "__init__.py:1: k3c (__init__) imports k3c.model (model): against the flow",
        "artifacts/build.py:3: k3c.artifacts.build (artifacts) imports k3c.runtimes (runtimes): against the flow",
        "compiler/targets.py:1: k3c.compiler.targets (compiler) imports k3c.cli (cli): against the flow",
        "errors.py:1: k3c.errors (errors) imports k3c.model.config (model): against the flow",
        "exporter/onnx.py:2: k3c.exporter.onnx (exporter) imports k3c.passes.onnx_ops (passes): against the flow",
        "model/convert.py:1: k3c.model.convert (model) imports k3c.artifacts.bundle (artifacts): against the flow",
    ]


def test_a_folder_outside_the_layout_is_named(tmp_path):
    root = package(tmp_path, {"plugins/extra.py": "", "tests_like/t.py": ""})
    (root / "scripts").mkdir()
    (root / "scripts" / "tool.py").write_text("from k3c.cli import main\n")   # not a package: not read
    assert sorted(messages(root)) == [
        "plugins/__init__.py:1: k3c.plugins: 'plugins' is not a layer of k3c.tools.layers.LAYERS",
        "plugins/extra.py:1: k3c.plugins.extra: 'plugins' is not a layer of k3c.tools.layers.LAYERS",
        "tests_like/__init__.py:1: k3c.tests_like: 'tests_like' is not a layer of k3c.tools.layers.LAYERS",
        "tests_like/t.py:1: k3c.tests_like.t: 'tests_like' is not a layer of k3c.tools.layers.LAYERS",
    ]


def test_command_exits_1_and_prints_each_import(tmp_path):
    root = package(tmp_path, {"model/convert.py": "from ..artifacts.bundle import atomic_dir\n",
                              "artifacts/bundle.py": "from ..model import config\n"})
    r = subprocess.run([sys.executable, "-m", "k3c.tools.layers", str(root)], capture_output=True, text=True)
    assert r.returncode == 1
    assert r.stdout.splitlines() == [f"{root / 'model' / 'convert.py'}:1: k3c.model.convert (model) imports "
                                     "k3c.artifacts.bundle (artifacts): against the flow"]
    (root / "model" / "convert.py").write_text("from ..errors import K3Error\n")
    r = subprocess.run([sys.executable, "-m", "k3c.tools.layers", str(root)], capture_output=True, text=True)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")


def test_the_package_follows_its_layers():
    r = subprocess.run([sys.executable, "-m", "k3c.tools.layers"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr

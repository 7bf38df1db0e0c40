"""Third-party warnings filtered at their one source, precisely (by message and category)."""
from __future__ import annotations

import contextlib
import warnings


# torch 2.13's ExportedProgram.run_decompositions deep-copies the module call graph; copying a pytree
# LeafSpec goes through its deprecated constructor, which warns "`isinstance(treespec, LeafSpec)` is
# deprecated" (a FutureWarning about torch's own code) once per leaf. Every run_decompositions of
# k3c's (exporter/export.py decompose, torch.onnx.export's in exporter/onnx_export.py, torch-mlir's in
# ops/trace.py) runs under this filter, which drops only that warning.
@contextlib.contextmanager
def leafspec_deprecation_silenced():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        yield

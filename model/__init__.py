"""The K3 reference model in PyTorch: config, modules, checkpoints (docs/model.md §0-6); the custom ops
and the MXFP4 format it uses are ops/.

The config (``K3Config``, the presets) imports no torch: opening a bundle to run it reads its config
and needs nothing else of the model. ``K3Model`` and ``K3State`` are imported on first use, which
loads torch and registers ``torch.ops.k3.*`` (about 3 s on a 2-core host, docs/bundle.md §4)."""
from .config import K3Config
from .config_keys import ConfigError
from .presets import PRESETS

__all__ = ["ConfigError", "K3Config", "K3Model", "K3State", "PRESETS"]


def __getattr__(name: str):
    if name in ("K3Model", "K3State"):
        from . import model
        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

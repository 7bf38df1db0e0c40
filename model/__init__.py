"""The K3 reference model in PyTorch: config, modules, custom ops, checkpoints, MXFP4 (docs/model.md §0-6)."""
from .config import ConfigError, K3Config, PRESETS
from .model import K3Model, K3State

__all__ = ["ConfigError", "K3Config", "K3Model", "K3State", "PRESETS"]

"""The K3 reference model in PyTorch: config, modules, checkpoints (docs/model.md §0-6); the custom ops
and the MXFP4 format it uses are ops/."""
from .config import K3Config
from .config_keys import ConfigError
from .presets import PRESETS
from .model import K3Model, K3State

__all__ = ["ConfigError", "K3Config", "K3Model", "K3State", "PRESETS"]

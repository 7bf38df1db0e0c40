"""exporter: K3Model entry points (prefill, decode) -> torch.export -> torch-mlir torch-dialect MLIR."""

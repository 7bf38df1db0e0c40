"""passes: MLIR rewrites that replace each torch.k3.* custom op with a per-target implementation."""

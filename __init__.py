"""k3c: compile Kimi K3 / Kimi Linear checkpoints for CPU, CUDA, ROCm and Vulkan with IREE."""
__version__ = "0.1.0"

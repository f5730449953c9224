"""The kernel-injected path: CUDA kernels, their plain-torch references, and injection into HF models."""

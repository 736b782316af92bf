"""GPU-specific speed: Triton kernels for the fused layers' pointwise work (`cuda_triton_ops`)."""

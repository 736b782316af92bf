"""CPU-specific speed: native C kernels, oneDNN-packed linears, fused RMSNorm, OpenMP and malloc tuning."""

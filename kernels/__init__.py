"""Fused kernels (RMSNorm, RoPE, SwiGLU, attention, cross-entropy): a registry of backends per device."""

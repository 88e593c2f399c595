"""Kernels by target: `cpu/` (C++ compiled on first use, called through XLA FFI) and `gpu/` (Pallas)."""

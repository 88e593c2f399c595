"""Native CPU kernels (C++ sources compiled on first use) and their JAX bindings."""

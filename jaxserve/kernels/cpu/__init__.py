"""jaxserve's CPU kernels: C++ sources compiled on first use (`library`), their JAX bindings (`matmul`,
`matmul_int8`, `attention`) and the per-machine plan of which row counts use them (`kernel_choice`, `kernel_plan`)."""

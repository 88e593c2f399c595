"""Paged attention over a ragged batch: the metadata, the backend contract and its choice (`backend`, `select`),
and one file per backend: the jnp reference (`reference`, over `paged_attention`), the CPU C++ kernel (`cpu`, over
`cpu_attention`) and the Pallas kernel for NVIDIA GPUs (`pallas`)."""

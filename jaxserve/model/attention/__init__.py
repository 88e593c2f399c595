"""Paged attention over a ragged batch: the metadata, the backend contract and its choice (`backend`, `select`), the
jnp reference (`reference`, over `paged_attention`), quantized KV pages (`kv_quant`) and MLA's latent attention. The
kernels live in jaxserve/kernels/ (cpu/ and gpu/)."""

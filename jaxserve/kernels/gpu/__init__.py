"""jaxserve's GPU kernels, in Pallas (Triton): ragged paged attention (`ragged_paged_attention`), split-KV decode
attention (`split_kv_decode`) and the few-row matmul of decode steps (`matvec`)."""

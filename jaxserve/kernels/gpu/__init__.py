"""jaxserve's GPU kernels, in Pallas: ragged paged attention (`ragged_paged_attention`)."""

"""Model quality measured through the engine: `jaxserve eval perplexity` (prompt logprobs over held-out text)."""

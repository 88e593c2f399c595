"""Speculative decoding: proposers (n-gram lookup, a draft model), verification inside the ragged step, rejection
sampling that keeps the target distribution. See docs/speculative.md."""

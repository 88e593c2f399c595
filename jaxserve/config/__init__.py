"""Configuration dataclasses, built once from `LLM(...)` keyword arguments or CLI flags: the engine's and
speculative decoding's."""

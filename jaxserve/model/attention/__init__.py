"""Paged attention over a ragged batch: its metadata, the jnp implementation and the CPU C++ kernel's binding."""

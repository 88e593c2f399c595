"""The jaxserve planner: roofline + queueing capacity model. Pure Python and numpy; never imports JAX."""

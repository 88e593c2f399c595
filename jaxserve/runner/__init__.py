"""The device side of a step: building the model and KV pool, the jitted forward and sampler, sharding over a mesh
and multi-host lockstep.
"""

"""What a model is, in numbers: `ModelSpec` (shapes, presets, HF config.json), the memory formula that sizes a KV
pool, dtype sizes and MoE tile counts. Pure Python: the planner and the runtime both import it, neither owns it."""

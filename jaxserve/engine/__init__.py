"""Engines: the synchronous LLMEngine, the background AsyncEngine, the offline LLM, disaggregated prefill/decode and
the factory that builds one from an EngineConfig.
"""

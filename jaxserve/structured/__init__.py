"""Structured outputs and tool calls: grammars compiled into per-step token masks (grammar.py) within checked
bounds (limits.py), compiled for the server in worker processes (compiler.py, compile_worker.py) and cached by
bytes (grammar_cache.py); tool calls enforced by grammars that end (tool_grammar.py) and parsed from the output
(tools.py)."""

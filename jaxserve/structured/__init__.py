"""Structured outputs and tool calls: grammars compiled into per-step token masks (grammar.py), tool calls parsed
from the output (tools.py)."""

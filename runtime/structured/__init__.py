"""Structured output: guides (JSON schemas, regexes, choices, grammars, tool calls) as xgrammar
grammars (grammars.py, built in the engine's builder process, builder.py) and the per-slot token masks the engine applies
before its draw (masks.py)."""

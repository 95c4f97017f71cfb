"""Structured output: guides (JSON schemas, regexes, choices, grammars, tool calls) as xgrammar
grammars (grammars.py, in the tokenizer actor) and the per-slot token masks the engine applies
before its draw (masks.py)."""

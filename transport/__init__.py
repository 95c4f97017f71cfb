"""Shared-memory transport: segments, SPSC rings of variable-size frames, eventfd wake-ups."""

"""Deterministic workflow code only: no I/O, clocks, randomness or threads."""

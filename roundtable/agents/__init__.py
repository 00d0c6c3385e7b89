"""Model adapters: one small interface, many backends."""

from roundtable.agents.base import ModelAdapter, UnknownModelError, resolve_model

__all__ = ["ModelAdapter", "UnknownModelError", "resolve_model"]

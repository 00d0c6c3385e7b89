"""Roundtable: LLM agents in rounds whose writes are approved, leased and audited."""

__version__ = "0.1.0"

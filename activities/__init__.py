"""Every side effect of a run: database, model calls, tool calls."""

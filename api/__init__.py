"""The HTTP API: runs, approvals, actions, events, health."""

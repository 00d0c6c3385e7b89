"""Metrics, traces and logs: what SREs see of a running Roundtable."""

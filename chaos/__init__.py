"""The chaos harness (issue 10, sections 1 and 5): a contended workload through
the public surfaces, faults at moments a seed chooses, then the invariant
checker and a canary scan. Run it as ``python -m chaos --seed 7 --duration 600``."""

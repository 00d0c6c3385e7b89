"""Tools: the registry, write policies and the demo ticket system."""

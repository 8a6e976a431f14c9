"""Tools that drive an engine to measure it."""

"""Adaptive speculation: a measured cost model and the goodput controller that picks k."""

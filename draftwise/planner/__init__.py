"""Whether speculation will pay on a given traffic, machine and concurrency: measure, simulate, recommend."""

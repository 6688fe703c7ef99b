"""Benchmarks of the serving runtime (``mstar bench ...``)."""

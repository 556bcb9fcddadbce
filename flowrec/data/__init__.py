"""Data staging: sources and converters, encoding, synthetic data, batches, lookahead, profiling.

Modules are imported on use (`from flowrec.data.batches import iterate_batches`); this package
itself imports nothing heavy, so the planner and the CLI start fast.
"""

"""Support for tests and benchmarks: a synthetic engine, a daemon launcher and the daemon's service in process.

Not used in serving.
"""

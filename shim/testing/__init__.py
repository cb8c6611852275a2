"""Support for tests and benchmarks: a synthetic engine and a daemon launcher. Not used in serving."""

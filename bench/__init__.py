"""qdelay benchmarks: ``python -m bench.<name>`` (see docs/benchmarks.md)."""

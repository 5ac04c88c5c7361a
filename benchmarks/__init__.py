"""Maintained benchmarks of underlay: ``python -m benchmarks.<cpu|gpu>.bench_<name>`` (see README.md)."""

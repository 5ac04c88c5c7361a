"""Benchmarks that run on the CPU (some also take ``--device cuda``)."""

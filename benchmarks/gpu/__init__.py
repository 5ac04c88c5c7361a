"""Benchmarks that need a CUDA GPU (most have a ``--device cpu --quick`` smoke run)."""

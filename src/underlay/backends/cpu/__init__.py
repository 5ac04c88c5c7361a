"""CPU device backend."""

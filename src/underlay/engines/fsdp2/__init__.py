"""FSDP2 engine and weight loader."""

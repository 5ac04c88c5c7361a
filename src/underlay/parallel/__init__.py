"""Process groups, device meshes and sequence-parallel primitives."""

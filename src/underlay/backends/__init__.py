"""Backend implementations. Each subpackage is one backend family; they never import each other.
``_accelerator`` is shared plumbing for torch device modules, not a backend."""

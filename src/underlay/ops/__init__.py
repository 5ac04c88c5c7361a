"""Device-agnostic math in plain torch. Imports only ``underlay.interfaces``."""

"""Small shared helpers (hardware tables, environment parsing). Import only ``interfaces``."""

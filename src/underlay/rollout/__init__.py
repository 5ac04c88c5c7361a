"""Rollout interface: weight sync to inference engines, rollout trace and replay."""

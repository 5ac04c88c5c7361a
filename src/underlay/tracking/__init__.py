"""Experiment tracking (console, jsonl, TensorBoard, ...)."""

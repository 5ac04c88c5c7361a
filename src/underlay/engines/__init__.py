"""Parallel engines: ``ParallelEngine`` + ``WeightLoader`` (+ ``WeightMap``) implementations.

Engines are composites: they orchestrate ``models``, ``ops`` and ``parallel`` primitives on the device
and kernels they are given through the interfaces. They never import each other, and device/kernel
backends never import them. Each engine package is imported only when it is selected.
"""

"""Optimizer conformance suite (see test_optimizer_conformance.py)."""

"""Fused optimizer updates: flat buffers and their planner, the strategies of every mode (the
protocol in strategy.py, built by registry.py), the fusability probe and the rounding routes.

Nothing here reads YAML or environment variables: the runtime passes plain arguments.
"""

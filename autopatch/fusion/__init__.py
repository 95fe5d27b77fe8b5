"""Fused optimizer updates: flat buffers, the multi-layer step and the fusability probe.

Nothing here reads YAML or environment variables: the runtime passes plain arguments.
"""

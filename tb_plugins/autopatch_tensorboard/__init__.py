"""TensorBoard plugin: the autopatch tab (autotune trials, frozen config, per-mode step times)."""

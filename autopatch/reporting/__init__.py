"""What autopatch says about a run: the JSON report and its summary, the sections rooms add, the
step timer that times training iterations, and the TensorBoard writer (rank 0)."""

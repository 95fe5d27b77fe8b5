"""When a part of the step stands out enough to advise on it: every threshold in one place.

Shares are of the whole step, the report's ``breakdown.share`` (fractions of the run's summed
step time)."""

DATA_WAIT_SHARE = 0.30          # waiting for batches: at least this share of the step
COMM_SHARE = 0.25               # exposed communication waits: at least this share
OPTIMIZER_SHARE = 0.25          # the optimizer step: at least this share ...
OPTIMIZER_MIN_TENSORS = 32      # ... over at least this many parameter tensors (fusion's case)
GRADIENT_MIB = 512              # gradients at least this large: freeing them early is worth saying
OWN_WORK_SHARE = 0.10          # autopatch's own work (autotune's search among it): at least this share

"""The names every room shares: fusion modes, gradient compressions, exactness levels, and the
communication algorithms.

One place, free of heavy imports, so the policy (read before torch is loaded), the mode chooser,
autotune and the communication room cannot drift apart in what they call a mode or a compression.
"""

OFF, AUTO = "off", "auto"
MULTI_LAYER, BACKWARD, FORWARD = "multi_layer", "backward", "forward"

FUSION_MODES = (MULTI_LAYER, BACKWARD, FORWARD)      # what fuses the update
WATCHED_MODES = (BACKWARD, FORWARD)                  # right for some loops only: the watch says which
SWITCHABLE_MODES = (OFF, *FUSION_MODES)              # what runs a step (auto chooses among these)
POLICY_MODES = (OFF, AUTO, *FUSION_MODES)            # what fusion.mode may say

COMPRESSIONS = ("none", "fp16", "bf16", "minmax_uint8")
EXACTNESS = ("bitwise", "rounding")

# Communication algorithms, by Bagua's names. The first two only change how gradients are averaged
# (the bucketed allreduce, bytegrad with 8-bit compression); the others exchange weights or
# Adam's first moment instead (comm/algorithms/).
GRADIENT_ALLREDUCE, BYTEGRAD = "gradient_allreduce", "bytegrad"
GRADIENT_ALGORITHMS = (GRADIENT_ALLREDUCE, BYTEGRAD)
ALGORITHMS = (*GRADIENT_ALGORITHMS, "decentralized", "low_precision_decentralized", "qadam", "async")
PEER_SELECTION_MODES = ("all", "shift_one")

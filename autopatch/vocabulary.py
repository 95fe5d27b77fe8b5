"""The names every room shares: fusion modes, gradient compressions, exactness levels.

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

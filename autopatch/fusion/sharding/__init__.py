"""Optimizer state sharded across the ranks of a DDP job: where runs are cut (shares.py), the
multi_layer step over this rank's share (sharded_step.py), and the whole state gathered back
(whole_state.py)."""

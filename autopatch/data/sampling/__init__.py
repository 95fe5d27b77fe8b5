"""The load-balanced samplers: each rank the same number of samples of about the same complexity
at every step, the scores every rank agrees on, and how evenly a sampler spreads the work."""

"""Whether the zero-code cache may serve a dataset, and whether it pays: the probe, the dataset's
signature (what it is, and the files it names), and the job's one decision on the payoff."""

"""What the benchmark scripts share, one idea per module:

- alternation: contenders take turns, the first rotating; medians, per-round ratios, quartiles;
- steps: training steps timed phase by phase, contenders side by side in one process;
- processes: contenders in processes of their own, driven round by round;
- launch: N gloo ranks over loopback; netns (with delay_line): over a shaped network;
- machine, report: the machine and code under test, Markdown tables;
- states, adoption: same training result?, one optimizer under autopatch alone;
- workloads, optimizers, memory: models and batches, BertAdam, peak resident memory.

Nothing is imported here, so ``tests/support/training.py`` can take ``BertAdam`` without pulling in
autopatch or the launchers.
"""

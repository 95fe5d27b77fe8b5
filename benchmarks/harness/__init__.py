"""What the benchmark scripts share, one idea per module:

- alternation: contenders take turns, the first rotating; medians, per-round ratios, quartiles;
- steps: training steps timed phase by phase, contenders side by side in one process;
- processes: contenders in processes of their own, driven round by round;
- launch: N gloo ranks over loopback; netns (with delay_line): over a shaped network;
- machine, report: the machine and code under test, Markdown tables;
- states, adoption: same training result?, one optimizer under autopatch alone;
- workloads, optimizers, memory: models and batches, BertAdam, peak resident memory;
- fsdp: FSDP2's ``fully_shard``, a one-rank group, GPT-2 and MLP stacks sharded as recipes shard them;
- gpu_workloads, gpu_contenders, gpu_job, gpu_runs, gpu_report: what ``bench_gpu.py``'s runs share
  (its workloads, its contenders, one contender's process, the runner that makes them take turns,
  the figures and Markdown).

Nothing is imported here, so ``tests/support/training.py`` can take ``BertAdam`` without pulling in
autopatch or the launchers.
"""

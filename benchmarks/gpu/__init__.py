"""The runs of ``bench_gpu.py``, one per module: the table (``table``), the largest model that
trains (``max_model``), the chunk-size sweep (``chunk_sweep``) and one-rank FSDP2 (``fsdp``).
Each is ``run_*(ctx, args, opts, info, tmp) -> (Markdown, exit status)``; what they share lives
in ``harness/`` (``gpu_workloads``, ``gpu_contenders``, ``gpu_job``, ``gpu_runs``, ``gpu_report``)."""

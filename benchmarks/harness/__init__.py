"""What the benchmark scripts share: taking turns, processes per contender, launching gloo ranks
(over plain or shaped loopback), the machine they ran on, and the workloads they train.

Each module holds one idea; import the module you need (``from harness import alternation``).
Nothing is imported here, so ``tests/training.py`` can take ``BertAdam`` without pulling in
autopatch or the launchers.
"""

"""World-size invariance (``trainer.world_size_invariant=true``): the same bits on 1, 2, 4 ranks.

``exact_sum``: int64 fixed-point sums; ``batchnorm``: ghost batches, running statistics once
per step; used by ``reduction.Exact``. How it works: docs/scaling-out.md.
"""

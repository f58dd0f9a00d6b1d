"""World-size invariance (``trainer.world_size_invariant=true``): the same bits on 1, 2, 4 ranks.

A step's global batch is k fixed micro-batches; rank r runs a fixed, contiguous subset of
them. What makes the result independent of which rank ran what:

- ``exact_sum``: gradients, losses, metric sums and BatchNorm statistics are summed in int64
  fixed point with a power-of-two scale every rank agrees on, so the sum is exact and its
  order does not matter (integer addition is associative; float addition is not).
- ``batchnorm``: BatchNorm normalises over each micro-batch (ghost batches) and its running
  statistics are updated once per step from the k micro-batches' statistics.
- per-micro-batch randomness: the global RNG is seeded from (train seed, global step,
  micro-batch index) around each micro-batch (``engine``), so no RNG state belongs to a rank.

The strategy that uses them is ``reduction.Exact``, chosen once per run.
"""

"""World-size invariance (``trainer.world_size_invariant=true``) for ``reduction.Exact``: exact
sums and BatchNorm per micro-batch, the same bits on 1, 2, 4 ranks (docs/scaling-out.md)."""

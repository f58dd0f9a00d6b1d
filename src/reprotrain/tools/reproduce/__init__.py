"""Replaying an archive: the trust decision, the replay plan and environment, the comparison."""

"""A worker's report applied to the tables: checked (validation), then its tokens,
finishes, preemptions and cache delta reconciled (reconcile)."""

"""What a worker says, applied to the tables: its registration, lease and leaving (workers,
with the settings the config gives it), and each report checked (validation), then its
tokens, finishes, preemptions and cache delta reconciled (reconcile)."""

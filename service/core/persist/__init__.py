"""Saving and recovering: the store contract (store), the unsaved changes (changes), the
save scope of each state-changing call (saving), rebuilding from a store (recovery) and
the scheduler of a replica over a shared store (replica)."""

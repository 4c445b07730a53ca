"""Durable state of the scheduler: the SQLite store, the PostgreSQL store, integrity checks, group commit."""

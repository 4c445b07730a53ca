"""Scheduler replicas sharing one PostgreSQL database (docs/replicas.md)."""

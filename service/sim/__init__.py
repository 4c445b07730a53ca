"""The trace-driven simulator (`lattice-scheduler simulate`): the real scheduling core and
WorkerLoop on a virtual clock, against simulated workers timed by a cost model."""

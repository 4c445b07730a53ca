"""The `lattice-scheduler` command line: serve, client commands, drain, state check, simulate, gateway."""

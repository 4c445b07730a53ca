"""The scheduler under a fleet's traffic (`python -m bench.traffic SUBCOMMAND`)."""

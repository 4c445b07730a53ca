"""Tools that drive the service from outside, for tests and scripts (never imported by the
running service): `fault_stack` (scheduler and scripted worker processes killed on
purpose, clients that check nothing acknowledged is lost; tests/faults, tests/replicas,
scripts/chaos.py), `honest_worker` (an in-process worker that counts pages and slots
like the reference engine; tests/unit, scripts/bench_policies.py)."""

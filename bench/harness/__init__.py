"""What the benchmarks and the tests share, driving the service from outside (never
imported by the running service): `fault_stack` (scheduler and scripted worker processes
killed on purpose, clients that check nothing acknowledged is lost; tests/faults,
tests/replicas, bench/chaos.py), `honest_worker` (an in-process worker that counts pages
and slots like the reference engine; tests/unit, bench/policies.py), `engine_bench` (the
engine benchmarks' workloads and in-process scheduler stack)."""

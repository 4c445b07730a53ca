"""What the benchmarks and the tests share, driving the service from outside (never
imported by the running service):

- `processes`: a scheduler (this checkout's or another's) and scripted workers started
  and waited for, their CPU and memory from /proc, a scheduler's metrics;
- `fake_worker`: a worker speaking the wire protocol from the benchmark's own process;
- `tables`: figures printed side by side, aligned or as markdown;
- `fault_stack`: scheduler and scripted worker processes killed on purpose, and clients
  that check nothing acknowledged is lost (tests/faults, tests/replicas, bench.chaos);
- `honest_worker`: an in-process worker that counts pages and slots like the reference
  engine (tests/unit, bench.policies);
- `engine_bench`: the engine benchmarks' workloads and in-process scheduler stack
  (bench.prefill, bench.worker, bench.prefix_cache).
"""

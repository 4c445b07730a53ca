"""Benchmarks and the tooling of tests, outside the product packages (never in the wheel,
never imported by service, worker_client, common or lattice).

Each benchmark runs from the repository root as `python -m bench.NAME` (`--help` says
what it measures); `bench.harness` holds what they and the tests share: processes started
and waited for, fake and scripted workers, fault stacks, tables printed side by side.
Figures and the commits they ran at: docs/benchmarks.md.
"""

"""Stacks for the fault tests: every process is killed at teardown, and the logs of each
are printed there (pytest shows them when the test failed)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.harness.fault_stack import Clients, Stack


@pytest.fixture
def make_stack(tmp_path) -> Iterator:
    """make_stack(**kwargs) -> a started Stack; make_clients(stack, jobs, ...) likewise."""
    stacks: list[Stack] = []

    def factory(**kwargs) -> Stack:
        stack = Stack(tmp_path / f"stack{len(stacks)}", **kwargs)
        stack.directory.mkdir(parents=True)
        stacks.append(stack)
        return stack.start()

    yield factory
    for stack in stacks:
        stack.close()
        print(stack.log_tails())


@pytest.fixture
def make_clients() -> Iterator:
    started: list[Clients] = []

    def factory(stack: Stack, jobs, **kwargs) -> Clients:
        started.append(Clients(stack.target, jobs, **kwargs).start())
        return started[-1]

    yield factory
    for clients in started:
        clients.close()

"""One observer that passes every call from the core on to several (metrics, wake-ups)."""
from __future__ import annotations

from service.core import SchedulerObserver


class FanOut(SchedulerObserver):
    """Calls each observer in turn, in the order given, for every hook of SchedulerObserver."""

    def __init__(self, *observers: SchedulerObserver) -> None:
        self._observers = observers


def _forward(name: str):
    def forward(self, *args, **kwargs) -> None:
        for observer in self._observers:
            getattr(observer, name)(*args, **kwargs)
    forward.__name__ = name
    return forward


# Every hook, including any the core adds later: a new hook needs no change here.
for _name in [n for n in vars(SchedulerObserver) if n.startswith("on_")]:
    setattr(FanOut, _name, _forward(_name))
del _name

"""One observer that passes every call from the core on to several (metrics, wake-ups)."""

from __future__ import annotations

from service.core import SchedulerObserver

# Every hook, including any the core adds later: a new hook needs no change here.
HOOKS = tuple(n for n in vars(SchedulerObserver) if n.startswith("on_"))


class FanOut(SchedulerObserver):
    """Calls each observer in turn, in the order given, for every hook of SchedulerObserver.

    The observers' methods are bound once, here, and a hook an observer leaves as the
    base class's no-op is not called at all: a decision's few hook calls each cost one
    call per observer that listens."""

    def __init__(self, *observers: SchedulerObserver) -> None:
        self._observers = observers
        for name in HOOKS:
            base = getattr(SchedulerObserver, name)
            listeners = tuple(
                method
                for method in (getattr(o, name) for o in observers)
                if getattr(method, "__func__", None) is not base or name in _NOT_NO_OPS
            )
            setattr(self, name, _fan(name, listeners))


# Base hooks that do something (on_tokens_reported calls on_tokens, which may be overridden).
_NOT_NO_OPS = frozenset({"on_tokens_reported"})


def _fan(name: str, listeners: tuple):
    if not listeners:

        def forward(*args, **kwargs) -> None:
            pass
    elif len(listeners) == 1:
        return listeners[0]
    else:

        def forward(*args, **kwargs) -> None:
            for listener in listeners:
                listener(*args, **kwargs)

    forward.__name__ = name
    return forward

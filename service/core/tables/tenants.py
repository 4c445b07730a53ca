"""How much service each tenant has had: the fair policy's Virtual Token Counter.

A tenant's counter grows by the tokens served to it (prompt tokens handed out in
prefill chunks, plus generated tokens as they are reported) divided by its weight.
The fair order serves the tenant with the lowest counter first. A tenant that becomes
active (its first queued or running sequence) starts no lower than the lowest counter
among the active tenants, so idle time banks no credit ("Fairness in Serving Large
Language Models", OSDI 2024).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping


class TenantLedger:
    """Weighted tokens served per tenant, and how many sequences each has in flight."""

    def __init__(self, weights: Mapping[str, float]) -> None:
        self._weights = dict(weights)
        self._served: dict[str, float] = {}
        self._active: Counter[str] = Counter()  # queued or assigned sequences

    def served(self, tenant: str) -> float:
        return self._served.get(tenant, 0.0)

    def restore(self, served: Mapping[str, float]) -> None:
        self._served.update(served)

    def activate(self, tenant: str) -> bool:
        """A sequence of `tenant` enters (submitted, or restored unfinished); True if its
        counter moved up to the active tenants' floor."""
        lifted = False
        if not self._active[tenant] and self._active:
            floor = min(self.served(t) for t in self._active)
            if self.served(tenant) < floor:
                self._served[tenant] = floor
                lifted = True
        self._active[tenant] += 1
        return lifted

    def restore_active(self, tenant: str) -> None:
        """An unfinished sequence of `tenant` loaded after a restart (its counter was
        saved as it was, lifted or not)."""
        self._active[tenant] += 1

    def deactivate(self, tenant: str) -> None:
        """A sequence of `tenant` finished."""
        self._active[tenant] -= 1
        if self._active[tenant] <= 0:
            del self._active[tenant]

    def charge(self, tenant: str, num_tokens: int) -> float:
        """Count `num_tokens` served to `tenant`; returns its new counter."""
        served = self.served(tenant) + num_tokens / self._weights.get(tenant, 1.0)
        self._served[tenant] = served
        return served

    def tentative(self) -> TentativeService:
        return TentativeService(self)


class TentativeService:
    """The counters as a plan being made sees them: its own charges on top of the
    ledger's, so tenants alternate inside one decision too. Discarded after planning
    (the mechanism charges the ledger with what it applies)."""

    def __init__(self, ledger: TenantLedger | None) -> None:
        self._ledger = ledger
        self._extra: dict[str, float] = {}
        self._weights = ledger._weights if ledger is not None else {}

    def served(self, tenant: str) -> float:
        if self._ledger is None:
            return 0.0
        return self._ledger.served(tenant) + self._extra.get(tenant, 0.0)

    def charge(self, tenant: str, num_tokens: int) -> None:
        if self._ledger is not None:
            self._extra[tenant] = self._extra.get(tenant, 0.0) + num_tokens / self._weights.get(
                tenant, 1.0
            )

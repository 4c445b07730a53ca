"""Deciding one worker's batch: a read-only view (plan.DecisionView) with what it sees of
the fleet's caches (fleet), the policy's plan (policies/), the check of the plan
(plan_check) and its application (batcher); the queue order a policy names (orders);
shedding a request at submit that could not start in time (shedding)."""

"""Deciding one worker's batch: a read-only view (plan.DecisionView), the policy's plan
(policies/), the check of the plan (plan_check) and its application (batcher); the
queue order a policy names (orders)."""

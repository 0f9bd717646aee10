"""The jitted update: the train step and its plan, log-probs, micro-batch splits, the
optimizer, the step's metrics, the analytic memory plan.

Imports `common`, `algorithm`, `models`, `parallel`; never the rollout side.
"""

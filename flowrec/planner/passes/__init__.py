"""Planner passes: each `def name(graph, ctx) -> PassResult`, pure and idempotent."""

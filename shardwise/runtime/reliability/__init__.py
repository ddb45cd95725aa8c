"""Guarantees against silent wrong results: the per-step check (step_guard.py)."""

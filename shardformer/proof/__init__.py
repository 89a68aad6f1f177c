"""Proof of a plan: a small twin of the model (twin.py) sharded with the plan and run whole (prove.py); an inferred
plan is used only once proven."""

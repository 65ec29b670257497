"""Callbacks the engine adds to a run's Trainer (classifier_engine/additions.py)."""

"""The run wing: what makes a run safe to start, stop and continue, one question per file (docs/reliability.md); the
run plan (classifier_engine/plan/) asks them in order."""

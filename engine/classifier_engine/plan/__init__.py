"""The run plan: every decision of a start, made once by passes over the parsed config (make.py), each with its
reason; the only writer of that config (edits.py); shown by --plan, saved as plan.yaml (run_plan.py)."""

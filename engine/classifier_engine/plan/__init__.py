"""The run plan's passes: every decision of a start, made once over the parsed config (make.py), each with its reason;
the plan itself is classifier_engine/run_plan.py, the only writer of that config classifier_engine/config_edits.py."""

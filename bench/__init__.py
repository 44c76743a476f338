"""gpu_planner benchmark: sweep, planners, harness and reports (`python -m bench.run`)."""

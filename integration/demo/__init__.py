"""The two-process prefill/decode demo: `gpu-planner demo`, push or pull."""

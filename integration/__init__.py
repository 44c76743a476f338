"""gpu_planner integrations: Mooncake send loop, metadata frames, sglang plugin, demo."""

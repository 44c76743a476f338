"""gpu_planner's integrations, one subpackage per product: `mooncake`, `sglang`, `demo`."""

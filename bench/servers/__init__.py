"""Real sglang servers on this machine for the benchmarks and the e2e suite (`tests/e2e`).

- `launcher`: server specs (CPU flags, prefill/decode/plain roles, the `smg`
  router), starting, readiness and stopping; `servers_running` for a deployment;
- `watchdog.py`: each server's keeper, which kills its process group when the
  launching process dies;
- `machine_lock`: one deployment at a time on a machine, across processes;
- `tiny_model`: the tiny random Llama the servers load (no download);
- `client`: requests by token id (plain and disaggregated) and `/metrics`;
- `cpu_scaffolding/`: what sglang 0.5.23 needs to serve on a CPU (put on the
  servers' PYTHONPATH, never imported here).
"""

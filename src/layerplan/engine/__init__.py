"""The engine: the one loop that runs a plan over a model's own modules (runner.py), step-owned KV
cache slots (cache.py), prepacked bf16 weights for oneDNN (cpu_pack.py)."""

"""The engine: the one loop that runs a plan over a model (runner.py), handed the model's executor
(executors.py: its modules, the native kernels of native.py, or modules placed by a device map),
step-owned KV cache slots (cache.py), prepacked bf16 weights for oneDNN (cpu_pack.py); loading a
model to run (load.py) after its architecture's check against transformers (verify.py)."""

"""Models: every per-architecture fact (architectures.py); finding and loading models (loading.py)."""

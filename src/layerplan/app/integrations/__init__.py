"""Bridges to tools users already have: transformers' `generate` (hf_generate) and
lm-evaluation-harness (harness)."""

"""Decoding: plain and speculative generation (generate.py, speculative.py), the acceptance rule,
draft lengths, sampling, and what a generation returns (output.py). Drafters live in drafters/."""

"""Drafters: the protocol and shared loop (base.py), one file per kind, the heads that turn a
draft's residual stream into logits (heads.py), and the spec-string registry (registry.py)."""

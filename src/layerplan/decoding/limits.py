"""The ranges a request's values may take, as plain data (no torch): the command line checks them
as it reads a command (app/options.py), before anything imports torch."""

from __future__ import annotations

SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)  # torch.Generator.manual_seed's range (choice.py takes it modulo 2**64)

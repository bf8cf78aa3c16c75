"""lm_eval's own command line with the "layerplan" model registered:

    python -m layerplan.app.integrations.lm_eval_cli --model layerplan \
        --model_args pretrained=smollm2,plan=exit:24 --tasks arc_easy [any other lm_eval option]

Why a wrapper: lm_eval 0.4.13 (`lm_eval/api/registry.py`, `lm_eval/models/__init__.py`) finds a
model only in its registry, which holds its own models and those of modules imported before the
run; it reads no entry points and has no option that imports a plugin. So the plain `lm_eval
--model layerplan` command answers "no model for this name found", and this module is that same
command (lm_eval.__main__.cli_evaluate, every option as is) after importing
layerplan.app.integrations.harness. Without a GPU, lm_eval's default device (cuda:0) falls back to
the CPU with a warning. `layerplan eval` is the short way for layerplan's own options.
"""

from __future__ import annotations

import sys

from lm_eval.__main__ import cli_evaluate

import layerplan.app.integrations.harness  # noqa: F401  (registers the "layerplan" model)


def main() -> None:
    sys.exit(cli_evaluate())


if __name__ == "__main__":
    main()

"""Regenerate models/architecture_status.json, the status of every causal LM of the installed
transformers (`layerplan models --architectures` prints it, docs/architectures.md lists it):

    python -m layerplan.app.architecture_status               # the model types not listed yet
    python -m layerplan.app.architecture_status TYPE [TYPE…]  # these again

Each model type is checked as `layerplan models --check TYPE` checks it (engine/verify.py: the
identity plan against transformers on a tiny random config of transformers' default config of
it). One refused by its config goes to `refused` with the reason; one that fails goes to
`not_supported` with what failed. One that passes is printed as a candidate and written nowhere:
it joins `tiny_checked` by hand once tests/test_architectures.py's tests of it (identity, exit,
repeat/export, speculative) pass. `mixture_of_experts` gains the types whose default config has
several experts. Entries of types not named stay as they are (hand-written reasons among them),
and `checked_with` becomes the installed transformers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from layerplan.engine.verify import run_check
from layerplan.files import write_text_atomic
from layerplan.models import architectures
from layerplan.models.architectures import refusal_of_config

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def status_path() -> Path:
    return Path(architectures.__file__).with_name(architectures.STATUS_FILE)


def _several_experts(config) -> bool:
    return any(isinstance(getattr(config, key, None), int) and getattr(config, key) > 1 for key in EXPERT_KEYS)


def update(status: dict, model_types: list[str], transformers_version: str) -> list[str]:
    """Check `model_types` and file each in `status` (changed in place); the ones that passed."""
    from transformers import AutoConfig

    passed = []
    for model_type in model_types:
        status["refused"].pop(model_type, None)
        status["not_supported"].pop(model_type, None)
        try:
            config = AutoConfig.for_model(model_type)
        except Exception as error:  # noqa: BLE001 - transformers' own config may not even validate
            first = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
            status["not_supported"][model_type] = f"transformers' own default config of it does not validate ({first})"
            continue
        if _several_experts(config) and model_type not in status["mixture_of_experts"]:
            status["mixture_of_experts"] = sorted({*status["mixture_of_experts"], model_type})
        refusal = refusal_of_config(config)
        if refusal:
            status["refused"][model_type] = refusal
            continue
        result = run_check(config)
        if result.passed:
            passed.append(model_type)
        else:
            status["not_supported"][model_type] = result.detail.removeprefix(f"architecture '{model_type}' ")
    status["refused"] = dict(sorted(status["refused"].items()))
    status["checked_with"] = f"transformers {transformers_version}"
    return passed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_types", nargs="*", help="check these again (default: the types not listed yet)")
    args = parser.parse_args(argv)
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = status_path()
    status = json.loads(path.read_text(encoding="utf-8"))
    listed = set(status["tiny_checked"]) | set(status["refused"]) | set(status["not_supported"])
    todo = args.model_types or sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - listed)
    passed = update(status, todo, transformers.__version__)
    write_text_atomic(path, json.dumps(status, indent=1, ensure_ascii=False) + "\n")
    print(f"checked {len(todo)} model type(s) against transformers {transformers.__version__}; wrote {path}")
    for model_type in passed:
        if model_type not in status["tiny_checked"]:
            print(f"passed: {model_type} (add it to tiny_checked once tests/test_architectures.py passes for it)")


if __name__ == "__main__":
    main()

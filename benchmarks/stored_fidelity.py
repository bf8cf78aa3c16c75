"""A GGUF run as stored against transformers' own dequantized float32 model of the same file:
the largest |difference| of the logits over a prompt, and whether greedy decoding agrees.

    python benchmarks/stored_fidelity.py smollm2
    python benchmarks/stored_fidelity.py path/to/gemma-3-270m-q4_k_m.gguf --new-tokens 64
    python benchmarks/stored_fidelity.py smollm2 --dtype stored-fast   # the integer products

Prints one JSON object (the model's formats, max |Δlogit|, relative to the largest logit, and
the greedy tokens that agree, the greedy prefix that agrees, and the prompt positions whose top-1
token agrees).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from layerplan.decoding.generate import generate
from layerplan.engine.choices import STORED, STORED_ARITHMETIC
from layerplan.engine.load import load_model
from layerplan.engine.runner import forward, new_cache

PROMPT = "The history of the printing press begins in the fifteenth century, when"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default=STORED, choices=list(STORED_ARITHMETIC))
    args = parser.parse_args(argv)
    stored = load_model(args.model, dtype=args.dtype)
    reference = load_model(args.model, dtype="float32", engine="eager")
    ids = stored.encode(PROMPT)
    with torch.no_grad():
        want = reference.hf(ids).logits
    got = forward(stored, ids, cache=new_cache(stored.plan(), ids.shape[1] + 1))
    difference = (got - want).abs().max().item()
    ours = generate(stored, ids, max_new_tokens=args.new_tokens, stop_at_eos=False).token_ids
    theirs = generate(reference, ids, max_new_tokens=args.new_tokens, stop_at_eos=False).token_ids
    prefix = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(theirs))
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(json.dumps({
        "model": args.model, "dtype": args.dtype, "formats": stored.stored.formats, "prompt_tokens": ids.shape[1],
        "max_abs_logit_difference": difference, "relative": difference / want.abs().max().item(),
        "greedy_tokens_equal": sum(a == b for a, b in zip(ours, theirs)), "greedy_tokens": len(theirs),
        "greedy_identical": ours == theirs, "greedy_common_prefix": prefix, "prompt_top1_agreement": top1,
    }, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])

"""How close each arithmetic of a GGUF run as stored is to llama.cpp and to transformers, on one
prompt: per arithmetic (stored: exact products; stored-fast: llama.cpp's integer products),
- against transformers' float32 model of the file (the dense reference): the largest |Δlogit| over
  the prompt's positions (and relative to the largest logit), the prompt positions whose top-1
  token agrees, and the greedy tokens that agree before the first difference;
- against llama.cpp's own server on the same file: the prompt positions whose next-token choice
  (llama-server's greedy token after each prefix) is ours, and the greedy tokens that agree.
The prompt is tokenized by llama.cpp (/tokenize) and every run is fed those ids.

    python benchmarks/fidelity_vs_llamacpp.py FILE [--new-tokens 48]

Prints one JSON object. Needs llama.cpp's tools (`layerplan peers build`).
"""

from __future__ import annotations

import argparse
import json

import torch

from layerplan.app.llamacpp import find_tools, peer_name
from layerplan.app.peers import llama_server, llama_server_call, llama_server_greedy
from layerplan.decoding.generate import generate
from layerplan.engine.load import load_model
from layerplan.engine.runner import forward, new_cache
from layerplan.machine import read_cpuinfo

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a goldsmith "
          "in Mainz, combined movable metal type with an oil-based ink and a wooden press adapted from")


def _llama_cpp(base: str, ids: list[int], new_tokens: int) -> tuple[list[int], list[int]]:
    """(llama.cpp's greedy token after each prefix of ids, its greedy continuation of ids)."""
    nexts = [llama_server_greedy(base, ids[:k], 1)[0] for k in range(1, len(ids) + 1)]
    return nexts, llama_server_greedy(base, ids, new_tokens)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    tools = find_tools(("llama-server",))
    if tools is None:
        raise SystemExit("llama.cpp's tools are not built: layerplan peers build")
    with llama_server(tools, args.model, args.threads) as base:
        ids = llama_server_call(base, "/tokenize", {"content": PROMPT, "add_special": True})["tokens"]
        peer_nexts, peer_greedy = _llama_cpp(base, ids, args.new_tokens)
    torch.set_num_threads(args.threads)
    reference = load_model(args.model, dtype="float32", engine="eager")
    prompt = torch.tensor([ids])
    with torch.no_grad():
        want = reference.hf(prompt).logits[0]
    dense_greedy = generate(reference, ids, max_new_tokens=args.new_tokens, stop_at_eos=False).token_ids
    del reference
    rows = {}
    for dtype in ("stored", "stored-fast"):
        model = load_model(args.model, dtype=dtype)
        got = forward(model, prompt, cache=new_cache(model.plan(), len(ids) + 1), last_only=False)[0]
        ours_next = got.argmax(-1).tolist()
        greedy = generate(model, ids, max_new_tokens=args.new_tokens, stop_at_eos=False).token_ids
        difference = (got - want).abs().max().item()
        rows[dtype] = {
            "vs_transformers_float32": {
                "max_abs_dlogit": float(f"{difference:.3g}"),
                "relative": float(f"{difference / want.abs().max().item():.3g}"),
                "prompt_top1_agreement": round(sum(a == b for a, b in zip(ours_next, want.argmax(-1).tolist()))
                                               / len(ids), 3),
                "greedy_common_prefix": f"{_common_prefix(greedy, dense_greedy)} of {args.new_tokens}"},
            "vs_llama_cpp": {
                "prompt_next_token_agreement": round(sum(a == b for a, b in zip(ours_next, peer_nexts)) / len(ids), 3),
                "greedy_common_prefix": f"{_common_prefix(greedy, peer_greedy)} of {args.new_tokens}"},
        }
        del model
    print(json.dumps({"model": args.model, "cpu": read_cpuinfo()[0], "llama_cpp": peer_name(tools),
                      "prompt_tokens": len(ids), "new_tokens": args.new_tokens,
                      "transformers_float32_vs_llama_cpp": {
                          "prompt_next_token_agreement": round(sum(
                              a == b for a, b in zip(want.argmax(-1).tolist(), peer_nexts)) / len(ids), 3),
                          "greedy_common_prefix": f"{_common_prefix(dense_greedy, peer_greedy)} of {args.new_tokens}"},
                      "arithmetics": rows}, indent=2))


if __name__ == "__main__":
    main()

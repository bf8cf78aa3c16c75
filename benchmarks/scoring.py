"""Where a scan candidate's scoring time goes on the default model, piece by piece, in one run.

    python benchmarks/scoring.py [--tokens 512] [--dtype bfloat16] [--repeats 15] [--scans 0]

Prints median milliseconds of: setting up a PlanEvaluator (reference forward, head,
probabilities); the LM head over all positions at once and in blocks of 64 and 256 rows; scoring
one candidate with the default chunking and with 64-row head blocks; argmax against amax and
logsumexp against the in-place max + exp-sum on one 32-row float32 chunk; and causal attention of
one layer's shape (SDPA in the model's dtype, SDPA in float32 on upcast inputs, and a blocked
bmm + softmax attention in float32). --scans N also runs N sub-layer scans and prints each one's
seconds and user CPU time (how much this shared machine drifts).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from layerplan.engine.runner import head, run_hidden
from layerplan.engine.load import load_model
from layerplan.search.evaluate import Reference, calibration_ids
from layerplan.search.evaluator import PlanEvaluator
from layerplan.search.scan import scan
from timing import median_ms


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Causal GQA attention in float32, query block by query block: q (1, H, T, D), k v (1, KV, T, D)."""
    heads, length, dim = q.shape[1:]
    groups = heads // k.shape[1]
    qf = q.float().reshape(k.shape[1], groups, length, dim)  # (KV, G, T, D)
    kf, vf = k.float()[0], v.float()[0]  # (KV, T, D)
    out = torch.empty(k.shape[1], groups, length, dim)
    for start in range(0, length, block):
        end = min(start + block, length)
        rows = qf[:, :, start:end].reshape(k.shape[1], groups * (end - start), dim)
        scores = torch.bmm(rows, kf[:, :end].transpose(1, 2)).mul_(dim ** -0.5).view(k.shape[1], groups, end - start, end)
        scores.masked_fill_(torch.ones(end - start, end, dtype=torch.bool).triu_(start + 1), float("-inf"))
        weights = torch.softmax(scores, -1).view(k.shape[1], groups * (end - start), end)
        out[:, :, start:end] = torch.bmm(weights, vf[:, :end]).view(k.shape[1], groups, end - start, dim)
    return out.reshape(1, heads, length, dim).to(q.dtype)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--scans", type=int, default=0)
    args = parser.parse_args()
    model = load_model("smollm2", dtype=args.dtype)
    ids = calibration_ids(model, tokens=args.tokens)
    r = args.repeats
    print(f"{model.name}, {args.dtype}, {torch.get_num_threads()} threads, {args.tokens} positions; median ms of {r}")

    setups = []
    for _ in range(4):
        start = time.perf_counter()
        PlanEvaluator(model, ids)
        setups.append(time.perf_counter() - start)
    print("evaluator set-up, four in a row: " + ", ".join(f"{s * 1e3:.0f}" for s in setups))

    hidden = run_hidden(model, ids)
    candidate = hidden + 0.01  # any other residual stream scores the same way
    n = hidden.shape[1]
    for rows in (n, 256, 64):
        ms = median_ms(lambda: [head(model, hidden[:, s : s + rows]) for s in range(0, n, rows)], r)
        print(f"LM head, {n} positions in blocks of {rows}: {ms:.1f}")
    reference = Reference.from_hidden(lambda h: head(model, h), hidden, ids)
    for chunk, rows in ((32, 256), (64, 64)):
        ms = median_ms(lambda: reference.divergence_of_hidden(lambda h: head(model, h), candidate, chunk=chunk,
                                                              head_rows=rows), r)
        print(f"scoring one candidate (head included), head blocks {rows}, metric chunks {chunk}: {ms:.1f}")

    logits = head(model, candidate[:, :32])[0].float()  # (32, V)
    print(f"one {tuple(logits.shape)} float32 chunk: argmax {median_ms(lambda: logits.argmax(-1), r * 4):.2f}, "
          f"amax {median_ms(lambda: logits.amax(-1), r * 4):.2f}, "
          f"logsumexp {median_ms(lambda: torch.logsumexp(logits, -1), r * 4):.2f}, "
          f"max + in-place exp-sum {median_ms(lambda: logits.clone().sub_(logits.amax(-1, keepdim=True)).exp_().sum(-1), r * 4):.2f} "
          f"(the last includes a copy)")

    config = model.hf.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    q = torch.randn(1, n, heads, dim, dtype=model.dtype).transpose(1, 2)  # the layout attention modules pass
    k = torch.randn(1, n, kv_heads, dim, dtype=model.dtype).transpose(1, 2)
    v = torch.randn(1, n, kv_heads, dim, dtype=model.dtype).transpose(1, 2)
    sdpa = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), r * 2)
    upcast = median_ms(lambda: F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                              enable_gqa=True).to(q.dtype), r * 2)
    blocked = median_ms(lambda: blocked_attention(q, k, v), r * 2)
    print(f"causal attention, one layer ({heads} heads, {kv_heads} KV heads, {n} positions): SDPA {sdpa:.2f}, "
          f"SDPA float32 on upcast inputs {upcast:.2f}, blocked float32 bmm + softmax {blocked:.2f}")

    for _ in range(args.scans):
        before = os.times()
        result = scan(model, ids, kinds=["attention", "mlp"])
        print(f"sub-layer scan: {result.seconds:.1f} s, user CPU {os.times().user - before.user:.1f} s")


if __name__ == "__main__":
    main()

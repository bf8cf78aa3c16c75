"""What a draft's LM head costs on the default model, and what a reduced vocabulary saves.

    python benchmarks/draft_heads.py [--dtype bfloat16] [--vocab 4096,8192,16384] [--repeats 200]

Times single-token steps (decode shape) in one run: the full LM head against reduced heads over
the K most frequent tokens of the built-in corpus, and a whole exit:E draft step with each, next
to a full-model step. Also reports how often the full model's greedy token lies inside each
reduced vocabulary (a ceiling on a reduced draft's acceptance), on the docs corpus the subset
was counted on and on standard-library code.
"""

from __future__ import annotations

import argparse

import torch

from layerplan.decoding.drafters.heads import ReducedHead, frequent_tokens
from layerplan.engine.runner import forward, head, new_cache, run_hidden
from layerplan.engine.load import load_model
from layerplan.search.evaluate import calibration_ids
from timing import median_ms


def timed(run, repeats: int) -> float:
    return median_ms(run, repeats, warmup=5)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--vocab", default="4096,8192,16384")
    parser.add_argument("--exit", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    model = load_model("smollm2", dtype=args.dtype)
    sizes = [int(v) for v in args.vocab.split(",")]
    heads = {k: ReducedHead(model, frequent_tokens(model, k)) for k in sizes}
    print(f"{model.name}, {args.dtype}, {torch.get_num_threads()} threads, vocabulary {model.hf.config.vocab_size}; "
          f"median ms of {args.repeats}")

    hidden = torch.randn(1, 1, model.hf.config.hidden_size, dtype=model.dtype)
    full_head = timed(lambda: head(model, hidden), args.repeats)
    plan = model.plan()
    cache = new_cache(plan, 200)
    context = calibration_ids(model, tokens=128)
    forward(model, context, plan, cache, 0)
    token = context[:, -1:]

    def step(p, reduced=None):
        def run():
            cache.crop(128)
            if reduced is None:
                forward(model, token, p, cache, 128, last_only=True)
            else:
                reduced(run_hidden(model, token, p, cache, 128))
        return run

    full_step = timed(step(plan), args.repeats)
    exit_plan = plan.with_exit(args.exit)
    exit_step = timed(step(exit_plan), args.repeats)
    print(f"full model step {full_step:.2f} ms; full LM head {full_head:.2f} ms = {full_head / full_step:.0%} of it")
    print(f"exit:{args.exit} draft step, full head: {exit_step:.2f} ms ({exit_step / full_step:.2f} of a full step)")

    from layerplan.corpus import code_corpus

    # the subset comes from the docs corpus: coverage there is in-sample, on code it is not
    greedy = {name: forward(model, calibration_ids(model, text, tokens=512)).argmax(-1).flatten()
              for name, text in (("docs", None), ("code", code_corpus()))}
    for k, reduced in heads.items():
        cost = timed(lambda: reduced(hidden), args.repeats)
        draft = timed(step(exit_plan, reduced), args.repeats)
        coverage = {n: float(torch.isin(g, reduced.ids).float().mean()) for n, g in greedy.items()}
        print(f"vocab {k:>6} ({reduced.size} ids): head {cost:.2f} ms ({full_head / cost:.1f}x cheaper); "
              f"exit:{args.exit} draft step {draft:.2f} ms ({draft / full_step:.2f} of a full step, "
              f"saves {exit_step - draft:.2f} ms); full model's greedy tokens inside: "
              f"{coverage['docs']:.1%} on docs (in-sample), {coverage['code']:.1%} on code")


if __name__ == "__main__":
    main()

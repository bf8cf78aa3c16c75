"""Where a decode's time goes outside the target's passes: each function of the speculative round
(and of a plain step) timed by a perf_counter wrapper in one process, the model loaded as
`layerplan generate` loads it (default settings, 2 threads, its objects frozen).

    python benchmarks/round_costs.py [MODEL] [--prompt chat] [--draft auto] [--runs 5] [--new-tokens 64]

Prints, per wrapped function, its mean microseconds a call and calls a run; then plain decoding's
and the draft's milliseconds a pass outside `forward` (record 426). The wrappers cost ~1 us a call.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import time

import torch

from layerplan.app.cli.common import load
from layerplan.app.prompts import CHAT_PROMPTS, PROMPTS
from layerplan.decoding import rounds, speculative, text
from layerplan.decoding.drafters import arbiter
from layerplan.decoding.generate import generate
from layerplan.engine import runner

seconds: collections.Counter = collections.Counter()
calls: collections.Counter = collections.Counter()


def wrap(owner, name: str, label: str) -> None:
    function = getattr(owner, name)

    @functools.wraps(function)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds[label] += time.perf_counter() - start
            calls[label] += 1

    setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("--prompt", default="chat", choices=list(PROMPTS))
    parser.add_argument("--draft", default="auto")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = load(args.model, "auto")
    gc.freeze()
    ids = model.encode(PROMPTS[args.prompt], chat=args.prompt in CHAT_PROMPTS)[0].tolist()

    Round = speculative.SpeculativeDecoding
    for owner, name, label in [(Round, "round", "round"), (Round, "propose", "propose"), (Round, "record", "record"),
                               (Round, "accept_chain", "accept chain"), (rounds, "chain_verdict", "verdict"),
                               (arbiter.Arbiter, "choices", "arbiter choices"), (text.Emitter, "emit", "emit"),
                               (text.TextStream, "update", "text stream update")]:
        wrap(owner, name, label)
    for module in (speculative, runner):  # each module's own `forward` name: tree passes, the others
        wrap(module, "forward", f"forward ({module.__name__.rsplit('.', 1)[-1]})")

    for draft in (None, args.draft):
        for _ in range(2):  # warm-up
            generate(model, ids, max_new_tokens=args.new_tokens, draft=draft)
        seconds.clear()
        calls.clear()
        total = 0.0
        for _ in range(args.runs):
            start = time.perf_counter()
            generate(model, ids, max_new_tokens=args.new_tokens, draft=draft)
            total += time.perf_counter() - start
        name = draft or "plain"
        passes = sum(calls[k] for k in calls if k.startswith("forward"))
        in_passes = sum(seconds[k] for k in seconds if k.startswith("forward"))
        print(f"{name}: {(total - in_passes) / passes * 1000:.3f} ms a pass outside forward "
              f"({passes / args.runs:.0f} passes a run, the prefill's included)")
        for label in calls:
            print(f"  {label:22s} {seconds[label] / calls[label] * 1e6:8.1f} us x {calls[label] / args.runs:.0f}/run")


if __name__ == "__main__":
    main()

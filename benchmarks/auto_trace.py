"""`--draft auto` against plain decoding, replayed: a trace recorded once on a real model, then the
arbiter run over it on a simulated clock, so that its policy can be checked in a unit test without
the model (tests/test_arbiter_replay.py) and a change to it measured on the text it lost on.

A trace holds, for one prompt's greedy output: every lookup drafter's proposal at every position
(greedy output is fixed, so a proposal's accepted length is its common prefix with the output),
the seconds one ask of each lookup took, one plain step's seconds and the verify pass costs
(k tokens, in plain steps) on the machine that recorded it, and the pass costs the arbiter was
told (this machine's probe row, as `generate --draft auto` tells it; the clock uses the measured
ones).

    python benchmarks/auto_trace.py record MODEL PROMPT OUT.json [--new-tokens N]
    python benchmarks/auto_trace.py replay TRACE.json...
    python benchmarks/auto_trace.py measure MODEL [--rounds R] [--front-end light]   (the real thing:
        auto against plain decoding timed alternately in one process, default settings, every
        built-in prompt; on the torch front end with this machine's probe row, or on the light one)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path


def _loaded(model_path: str):
    """The model as `layerplan generate` loads it (default settings), 2 threads, its objects frozen
    as the command freezes them (cli.common.freeze: no full collection walks the model mid-run)."""
    import torch

    from layerplan.app.cli.common import load

    torch.set_num_threads(2)
    model = load(model_path, "auto")
    gc.freeze()
    return model


def record(model_path: str, prompt_name: str, new_tokens: int = 64, repeats: int = 5) -> dict:
    import torch

    from layerplan.app.cli.common import checked_probe_row
    from layerplan.app.prompts import CHAT_PROMPTS, PROMPTS
    from layerplan.decoding.drafters.proposal import DraftState
    from layerplan.decoding.drafters.registry import make_drafter
    from layerplan.decoding.generate import generate
    from layerplan.engine.probe import time_passes
    from layerplan.machine import cpu_info

    model = _loaded(model_path)
    prompt = model.encode(PROMPTS[prompt_name], chat=prompt_name in CHAT_PROMPTS)[0].tolist()
    generate(model, torch.tensor([prompt]), max_new_tokens=4)  # warm-up
    steps = []
    for _ in range(repeats):
        result = generate(model, torch.tensor([prompt]), max_new_tokens=new_tokens)
        steps.append((result.seconds - result.prefill_seconds) / max(1, len(result.token_ids) - 1))
    output = result.token_ids
    plan = model.plan()
    with torch.inference_mode():  # the probe's timing of k-token passes after the prompt's length
        passes = time_passes(model, tuple(range(1, 10)), repeats, context=len(prompt))
    verify = {k: passes[k] / passes[1] for k in range(2, 10)}
    lookups = {}
    for drafter in make_drafter("auto", model).lookups:  # the lookups `--draft auto` asks
        name = drafter.name
        proposals, seconds = [], []
        for i in range(len(output) - 1):  # the round whose pending token is output[i]
            state = DraftState(model, plan, None, prompt + output[: i + 1], None)
            start = time.perf_counter()
            proposals.append(drafter.propose(state, 8).tokens[:8])
            seconds.append(time.perf_counter() - start)
        lookups[name] = {"ask_seconds": statistics.median(seconds), "proposals": proposals}
    row = checked_probe_row(model)  # what the arbiter is told a pass costs, as `generate --draft auto` tells it
    cpu = cpu_info()
    return {"model": model.name, "precision": model.precision, "prompt": prompt_name, "cpu": f"{cpu.model}, {cpu.isa}",
            "arbiter_pass_costs": dict(row.relative) if row is not None else {}, "threads": torch.get_num_threads(),
            "prompt_tokens": len(prompt), "output": output, "plain_step_seconds": statistics.median(steps), "verify_steps": verify, "lookups": lookups}


@dataclass
class Replay:
    plain_seconds: float  # the output's tokens after the first, one plain step each
    auto_seconds: float  # the arbiter's rounds on the simulated clock
    rounds: int
    drafted_rounds: int
    asks: int  # lookup asks, every one charged its recorded seconds

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.auto_seconds

    def to_dict(self) -> dict:
        return {**asdict(self), "speedup": self.speedup}


def replay(trace: dict, arbiter_options: dict | None = None, max_draft: int = 8) -> Replay:
    """The arbiter (drafters/arbiter.py) over the trace: each round's proposals are the recorded
    ones, its verify pass the recorded cost, and each lookup ask its recorded seconds."""
    from layerplan.decoding.drafters.arbiter import Arbiter
    from layerplan.decoding.drafters.proposal import Proposal, RoundOutcome

    output, step = trace["output"], trace["plain_step_seconds"]
    verify = {int(k): v for k, v in trace["verify_steps"].items()}
    clock = [0.0, 0]  # seconds, asks
    position = [0]

    class Recorded:
        def __init__(self, name: str) -> None:
            self.name, self.data = name, trace["lookups"][name]

        def propose(self, state, max_tokens: int) -> Proposal:
            clock[0] += self.data["ask_seconds"]
            clock[1] += 1
            return Proposal(list(self.data["proposals"][position[0]][:max_tokens]))

    told = {int(k): v for k, v in trace.get("arbiter_pass_costs", {}).items()}
    arbiter = Arbiter([Recorded(name) for name in trace["lookups"]], [], told, max_draft=max_draft,
                      **(arbiter_options or {}))
    rounds = drafted_rounds = 0
    while position[0] < len(output) - 1:
        i = position[0]
        left = len(output) - 1 - i - 1  # as SpeculativeRounds.propose: the last token is never drafted
        gamma = min(max_draft, left)
        start = clock[0]
        proposal = arbiter.propose(None, gamma) if gamma > 0 else Proposal()
        draft = proposal.tokens[:gamma]
        draft_seconds = clock[0] - start
        accepted = 0
        while accepted < len(draft) and draft[accepted] == output[i + 1 + accepted]:
            accepted += 1
        verify_seconds = step * (verify.get(len(draft) + 1, 1.0) if draft else 1.0)
        clock[0] += verify_seconds
        arbiter.observe(RoundOutcome(proposal.source if draft else None, len(draft), accepted, draft_seconds,
                                     verify_seconds))
        position[0] = i + accepted + 1
        rounds += 1
        drafted_rounds += bool(draft)
    return Replay(step * (len(output) - 1), clock[0], rounds, drafted_rounds, clock[1])


def measure(model_path: str, new_tokens: int = 64, rounds: int = 5) -> list[dict]:
    """Per built-in prompt: plain and `--draft auto` decoding (tokens after the first over the
    time after the prefill), alternated `rounds` times in one process on the model as `layerplan
    generate` loads it, with this machine's probe row as generate gives it; medians and ranges of
    the ratio, and whether the outputs are the same."""
    from layerplan.app.cli.common import checked_probe_row
    from layerplan.decoding.generate import generate

    model = _loaded(model_path)
    row = checked_probe_row(model)

    def decode(ids: list[int], tokens: int, drafted: bool):
        if not drafted:
            return generate(model, ids, max_new_tokens=tokens)
        return generate(model, ids, max_new_tokens=tokens, draft="auto", probe_row=row)

    return _alternated(lambda text, chat: model.encode(text, chat=chat), decode, new_tokens, rounds)


def _alternated(encode, decode, new_tokens: int, rounds: int) -> list[dict]:
    """Per built-in prompt (encode(text, chat): its ids), plain and auto decodes (decode(ids,
    tokens, drafted): a GenerationResult) alternated `rounds` times after a warm-up of each:
    medians and ranges of the ratio, and whether the outputs are the same."""
    from layerplan.app.prompts import CHAT_PROMPTS, PROMPTS

    rows = []
    for name, text in PROMPTS.items():
        ids = encode(text, name in CHAT_PROMPTS)
        decode(ids, 4, False)  # warm-up: first calls allocate
        decode(ids, 4, True)
        ratios, plain_rates, same = [], [], True
        for _ in range(rounds):
            plain, auto = decode(ids, new_tokens, False), decode(ids, new_tokens, True)
            same &= list(plain.token_ids) == list(auto.token_ids)
            plain_s, auto_s = plain.seconds - plain.prefill_seconds, auto.seconds - auto.prefill_seconds
            ratios.append(plain_s / auto_s)
            plain_rates.append((len(plain.token_ids) - 1) / plain_s)
        rows.append({"prompt": name, "auto_over_plain": statistics.median(ratios),
                     "range": [min(ratios), max(ratios)], "plain_tokens_per_second": statistics.median(plain_rates),
                     "tokens": len(plain.token_ids), "same_output": same,
                     "by_drafter": {k: [v["rounds"], v["drafted"], v["accepted"]]
                                    for k, v in auto.stats["by_drafter"].items()}})
    return rows


def measure_light(model_path: str, new_tokens: int = 64, rounds: int = 5) -> list[dict]:
    """measure's rows on the light front end, where `layerplan generate --draft auto` runs on a
    GGUF: decoding/rounds.py's loop on a LiteModel (default settings, 2 threads), a fresh arbiter
    a run as each command has, with this machine's cached probe row as the command reads it
    (LiteModel.probe_row; none cached: the arbiter learns the verify costs from its passes). No
    torch in the process."""
    from layerplan.lite.cli import decode_loop
    from layerplan.lite.model import LiteModel
    from layerplan.lite.request import ARITHMETICS
    from layerplan.models.gguf_place import gguf_of

    model = LiteModel(gguf_of(model_path), ARITHMETICS["auto"], threads=2)
    gc.freeze()
    plan = model.plan()
    row = model.probe_row()
    costs = dict(row.relative) if row is not None else {}
    print(f"probe row: {'none cached' if row is None else costs}", file=sys.stderr)

    def decode(ids: list[int], tokens: int, drafted: bool):
        return decode_loop(model, ids, plan, tokens, row, draft="auto" if drafted else None).run()

    return _alternated(lambda text, chat: model.encode(text, chat), decode, new_tokens, rounds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record")
    rec.add_argument("model")
    rec.add_argument("prompt")
    rec.add_argument("out", type=Path)
    rec.add_argument("--new-tokens", type=int, default=64)
    rep = commands.add_parser("replay")
    rep.add_argument("traces", type=Path, nargs="+")
    mea = commands.add_parser("measure")
    mea.add_argument("model")
    mea.add_argument("--rounds", type=int, default=5)
    mea.add_argument("--new-tokens", type=int, default=64)
    mea.add_argument("--front-end", choices=("torch", "light"), default="torch",
                     help="light: where `layerplan generate --draft auto` runs on a GGUF (no probe row)")
    args = parser.parse_args(argv)
    if args.command == "measure":
        measured = measure_light if args.front_end == "light" else measure
        for row in measured(args.model, args.new_tokens, args.rounds):
            low, high = row["range"]
            print(f"{args.model} {row['prompt']}: auto / plain {row['auto_over_plain']:.3f} ({low:.3f}-{high:.3f}), "
                  f"plain {row['plain_tokens_per_second']:.1f} tok/s, {row['tokens']} tokens, "
                  f"same output {row['same_output']}, drafted (rounds, tokens, accepted) {row['by_drafter']}")
        return
    if args.command == "record":
        trace = record(args.model, args.prompt, args.new_tokens)
        args.out.write_text(json.dumps(trace) + "\n")
        print(f"{args.out}: {trace['model']} {trace['prompt']}, step {1e3 * trace['plain_step_seconds']:.2f} ms, "
              + ", ".join(f"{n} ask {1e3 * data['ask_seconds']:.3f} ms" for n, data in trace["lookups"].items()))
    else:
        for path in args.traces:
            trace = json.loads(path.read_text())
            result = replay(trace)
            print(f"{path.name}: auto / plain {result.speedup:.3f} ({result.drafted_rounds} of {result.rounds} "
                  f"rounds drafted, {result.asks} lookup asks)")


if __name__ == "__main__":
    main(sys.argv[1:])

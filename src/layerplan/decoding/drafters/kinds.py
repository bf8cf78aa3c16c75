"""The kinds of drafter a --draft spec names, as data: each kind's keyword (the spec up to its
first ':'), how a spec writes it, what it drafts, and whether it takes +vocab=K; which specs the
light front end drafts by (drafts_a_lookup_chain). Nothing here imports torch, so that a
command's help lists the drafters without it; registry.py builds each kind (its builder
registered under the same keyword, checked there at import)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DrafterKind:
    syntax: str  # how a spec names it, for help texts
    help: str
    takes_head: bool = False  # accepts +vocab=K (a layer-plan draft)


# keyword -> kind; a spec with no known keyword is a plan (PLAN)
DRAFTERS: dict[str, DrafterKind] = {
    "ngram": DrafterKind("ngram, ngram:N", "prompt lookup: what followed the latest earlier n-gram (free)"),
    "suffix": DrafterKind("suffix[:corpus=FILE,max=N,share=P,learn,tree]", "the most frequent continuation of the "
                          "context's longest suffix match in the prompt, the generated text and a corpus file "
                          "(learn: and past outputs; tree: every continuation keeping share P, as a token tree "
                          "checked in one pass; free)"),
    "exit": DrafterKind("exit:E, exit:E+head[=PATH]", "exit after E steps of the target plan (+head: through "
                        "an exit head from `layerplan train-exit`)", takes_head=True),
    "window": DrafterKind("window:SINK,RECENT[/PLAN]", "attend to the first SINK and the RECENT latest tokens "
                          "only", takes_head=True),
    "dynamic": DrafterKind("dynamic:POLICY", "per-token early exit: confidence=P | entropy=H | cosine=C, then "
                           "min=N, every=K, vocab=K, kv=propagate|verify"),
    "model": DrafterKind("model:PATH", "a separate small model with the same tokenizer"),
    "self": DrafterKind("self:bits=FORMAT[/PLAN]", "the same model quantized again at load to a block format of "
                        "fewer bits (q4_0, q3_k, q2_k, ...; integer products), run by PLAN if given (exit:E, "
                        "skip:...), with a KV cache of its own"),
    "online": DrafterKind("online[:every=R,calibration=T,start=F]", "the target skipping the sub-layers that turn "
                          "the residual stream least on the last T verified tokens, re-chosen every R rounds, how "
                          "many by measured speed (no search needed)"),
    "auto": DrafterKind("auto", "per round, whichever of suffix, n-gram and the plan a search or tune saved for "
                        "this model is expected to give the most tokens per second (from measured acceptance "
                        "and the probe's verify costs), or a plain step when none pays"),
}
PLAN_KEYWORD = ""  # the builders' key of PLAN, a spec that is a plan
PLAN = DrafterKind("PLAN", "any plan string or file that only switches the target's sub-layers off "
                   "(skip:attn=3,5;mlp=9)", takes_head=True)


def drafter_help() -> str:
    """One line per kind of spec, for the CLI."""
    kinds = [*DRAFTERS.values(), PLAN]
    return "; ".join(f"{k.syntax}: {k.help}" for k in kinds) + (
        "; A|B: the first of several that proposes; add +vocab=K to a layer-plan draft for an LM head over "
        "the K most frequent tokens; add +branch=P to a draft that runs a model for a token tree where its "
        "top-1 probability is below P (greedy)")


def drafts_a_lookup_chain(spec: str) -> bool:
    """Whether a spec names one lookup drafter alone, proposing chains: ngram or suffix (not
    `A|B`, `+...`, nor a suffix `tree`, whose pass needs the torch front end's tree masks), which
    the light front end runs (drafters/lookup.py builds them)."""
    keyword, _, arg = spec.strip().partition(":")
    options = {item.partition("=")[0].strip() for item in arg.split(",")}
    return keyword in ("ngram", "suffix") and "|" not in spec and "+" not in spec and "tree" not in options

"""The kinds of drafter a --draft spec names, as data: each kind's keyword (the spec up to its
first ':'), how a spec writes it, what it drafts, and whether it takes +vocab=K; which specs the
light front end drafts by (drafts_on_the_light_front_end). Nothing here imports torch, so that a
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


# the kinds the light front end runs (their drafters run no torch module): lookups, the target's
# own sub-plans (a plan spec, exit:E, a window), auto over them, and another GGUF (model:PATH: the
# light front end hands it on where it does not run that file)
LIGHT_KINDS = ("ngram", "suffix", "exit", "window", "auto", "model", PLAN_KEYWORD)
HEAD_TAGS = ("+head", "+vocab=", "+branch=")  # what a spec adds to a layer-plan draft (registry.py _build)


def draft_models(spec: str) -> list[str]:
    """The files or folders a spec's `model:PATH` parts name (another model drafts)."""
    return [part.strip()[len("model:"):] for part in spec.split("|") if part.strip().startswith("model:")]


def drafts_on_the_light_front_end(spec: str) -> bool:
    """Whether the light front end runs a spec's drafter (registry.py builds it on a LiteModel):
    every `|` part of it a LIGHT_KINDS kind with no `+...` (an exit head, a reduced head, a branch)
    and no suffix `tree` (their passes need the torch front end's heads or tree masks)."""
    for part in spec.split("|"):
        keyword, _, arg = part.strip().partition(":")
        if keyword not in DRAFTERS:
            keyword = PLAN_KEYWORD
        options = {item.partition("=")[0].strip() for item in arg.split(",")}
        if keyword not in LIGHT_KINDS or any(tag in part for tag in HEAD_TAGS) or (keyword == "suffix"
                                                                                and "tree" in options):
            return False
    return True

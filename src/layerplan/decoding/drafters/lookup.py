"""The drafters that look their drafts up and run no model (n-gram, suffix): how their specs read
(registry.py's builders), and which drafters they are (drafts_by_lookup)."""

from __future__ import annotations

from collections.abc import Callable

from layerplan.decoding.drafters.ngram import NgramDrafter
from layerplan.decoding.drafters.proposal import Drafter
from layerplan.decoding.drafters.suffix import SuffixDrafter


def is_number(text: str, integer: bool) -> bool:
    try:
        int(text) if integer else float(text)
    except ValueError:
        return False
    return True


def ngram_drafter(arg: str | None, text: str) -> NgramDrafter:
    """`ngram` or `ngram:N` (arg: what follows the colon; text: the whole spec, for errors)."""
    if arg is None:
        return NgramDrafter()
    if not arg.isdigit():
        raise ValueError(f"cannot read '{text}': expected ngram or ngram:N with N the longest n-gram")
    return NgramDrafter(max_n=int(arg))


def suffix_drafter(arg: str | None, text: str, corpus_tokens: Callable[[str], list[int]]) -> SuffixDrafter:
    """`suffix[:corpus=FILE,max=N,share=P,learn,tree]`; corpus_tokens(FILE): the file's tokens
    (ValueError where it may not or cannot be read)."""
    options: dict = {}
    corpus: list[list[int]] = []
    for item in arg.split(",") if arg else []:
        key, eq, value = (part.strip() for part in item.partition("="))
        if key == "corpus" and value:
            corpus.append(corpus_tokens(value))
        elif key in ("max", "share") and is_number(value, integer=key == "max"):
            options["max_tokens" if key == "max" else "min_share"] = int(value) if key == "max" else float(value)
        elif key in ("learn", "tree") and not eq:
            options[key] = True
        else:
            raise ValueError(f"cannot read '{item}' in '{text}': expected suffix or "
                             "suffix:corpus=FILE,max=N,share=P,learn,tree")
    return SuffixDrafter(corpus, name=text, **options)


def drafts_by_lookup(drafter: Drafter) -> bool:
    """A drafter that looks its drafts up and runs no model (n-gram, suffix): cheap to make for each
    request, so a server gives every request of a batch its own (decoding/batch.py)."""
    return isinstance(drafter, (NgramDrafter, SuffixDrafter))

"""Suffix drafting (SuffixDecoding style): match the longest suffix of the context in a suffix
automaton over the request itself (prompt and generated text) and over an optional corpus (a
file tokenized once, and with `learn` the outputs of earlier requests: a server's past answers),
then propose the most frequent continuation of the match, token by token, while the chosen
token keeps at least `min_share` of the occurrences that continue. Costs no model call.

Both automata grow token by token (suffix_automaton.py); nothing is rebuilt per round. A new
request (a context that does not extend the previous one) starts a fresh request automaton.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from pathlib import Path

from layerplan.decoding.drafters.proposal import DraftState, Proposal
from layerplan.decoding.suffix_automaton import SuffixAutomaton
from layerplan.engine.tree import TreeShape
from layerplan.plan.plan import LayerPlan


class SuffixDrafter:
    def __init__(self, corpus: Sequence[Sequence[int]] = (), max_tokens: int = 16, min_share: float = 0.2,
                 learn: bool = False, name: str = "suffix", tree: bool = False) -> None:
        if max_tokens < 1:
            raise ValueError(f"a suffix draft needs max >= 1 tokens, got {max_tokens}")
        if not 0.0 <= min_share <= 1.0:
            raise ValueError(f"share is a fraction of the occurrences in [0, 1], got {min_share}")
        self.max_tokens, self.min_share, self.learn, self.name = max_tokens, min_share, learn, name
        self.tree = tree  # propose a token tree: every continuation that keeps min_share, likeliest first
        self.corpus = SuffixAutomaton()
        for document in corpus:
            self.add_document(document)
        self._reset()

    def _reset(self) -> None:
        self.request = SuffixAutomaton()
        self.fed: list[int] = []  # the context the request automaton holds
        self.prompt_length = 0  # of the request, for `learn`: only what was generated is remembered
        self.corpus_match = (0, 0)  # (state, length): the context's longest suffix found in the corpus

    def add_document(self, tokens: Sequence[int]) -> None:
        """Add a document (e.g. a past output) to the corpus automaton."""
        if tokens:
            self.corpus.extend_all(int(t) for t in tokens)
            self.corpus.end_document()

    def check(self, model, target: LayerPlan) -> None:
        pass  # text lookup fits any model and plan

    def _sync(self, context: list[int]) -> None:
        """Feed the tokens added to the context since the last round; start over on a new request."""
        fed = self.fed
        if len(context) < len(fed) or context[: len(fed)] != fed:
            if self.learn and len(fed) > self.prompt_length:
                self.add_document(fed[self.prompt_length - 1:])  # generated: from the first pending token on
            self._reset()
            fed = self.fed
        if not fed:
            self.prompt_length = len(context)  # the prompt and the pending first token
        state, length = self.corpus_match
        for token in context[len(fed):]:
            self.request.extend(token)
            state, length = self.corpus.match(state, length, token)
        self.corpus_match = (state, length)
        fed.extend(context[len(fed):])

    def propose(self, state: DraftState, max_tokens: int) -> Proposal:
        self._sync(state.tokens)
        own, own_length = self.request.longest_repeat()
        corpus, corpus_length = self.corpus.with_continuation(self.corpus_match[0])
        corpus_length = min(corpus_length, self.corpus_match[1])  # the state may hold longer strings
        if corpus_length > own_length:  # the longer match is the better evidence; ties go to the request
            automaton, start = self.corpus, corpus
        elif own_length:
            automaton, start = self.request, own
        else:
            return Proposal()
        if self.tree:
            return self._grow_tree(automaton, start, min(max_tokens, self.max_tokens))
        return Proposal(self._follow(automaton, start, max_tokens), None)

    def _grow_tree(self, automaton: SuffixAutomaton, state: int, budget: int) -> Proposal:
        """The `budget` likeliest continuations as a tree, best first: a node's likelihood is the
        product of its tokens' shares of the occurrences that continue (children below min_share
        are left out), so a dominant continuation grows a chain and an open choice branches."""
        tokens: list[int] = []
        parents: list[int] = []
        frontier = [(-1.0, 0, -1, state)]  # (-likelihood, tie-break, node, automaton state)
        order = 1
        while frontier and len(tokens) < budget:
            likelihood, _, node, at = heapq.heappop(frontier)
            follow = automaton.continuations(at)
            total = sum(follow.values())
            for token, count in sorted(follow.items(), key=lambda item: -item[1]):
                if count < self.min_share * total or len(tokens) >= budget:
                    break
                tokens.append(token)
                parents.append(node)
                heapq.heappush(frontier, (likelihood * count / total, order, len(tokens) - 1, automaton.next[at][token]))
                order += 1
        if not tokens:
            return Proposal()
        return Proposal(tokens, None, tree=TreeShape(tuple(parents)))

    def _follow(self, automaton: SuffixAutomaton, state: int, max_tokens: int) -> list[int]:
        """The most frequent continuation from `state`, while it keeps min_share of the occurrences."""
        tokens: list[int] = []
        for _ in range(min(max_tokens, self.max_tokens)):
            follow = automaton.continuations(state)
            if not follow:
                break
            token, count = max(follow.items(), key=lambda item: item[1])
            if count < self.min_share * sum(follow.values()):
                break
            tokens.append(token)
            state = automaton.next[state][token]
        return tokens


def read_corpus(path: str | Path, encode: Callable[[str], list[int]] | None, model_name: str) -> list[int]:
    """A corpus file's text as the model's tokens (encode: its tokenizer's, without special
    tokens; None: the model has none); one clear error line for a file that cannot be read, is not
    UTF-8 text or holds no text."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"suffix corpus '{path}': no such file") from None
    except IsADirectoryError:
        raise ValueError(f"suffix corpus '{path}' is a directory; give a text file") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"suffix corpus '{path}' is not UTF-8 text (byte {error.start})") from None
    except OSError as error:
        raise ValueError(f"cannot read suffix corpus '{path}': {error.strerror}") from None
    if not text.strip():
        raise ValueError(f"suffix corpus '{path}' holds no text")
    if encode is None:
        raise ValueError(f"suffix corpus '{path}': the model {model_name} has no tokenizer to read it with")
    return list(encode(text))

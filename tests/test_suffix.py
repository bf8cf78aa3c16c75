"""Suffix drafting: the suffix automaton against brute force, the drafter's proposals, and greedy
speculative decoding with it equal to plain greedy."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layerplan.decoding.drafters.proposal import DraftState
from layerplan.decoding.drafters.registry import make_drafter
from layerplan.decoding.drafters.suffix import SuffixDrafter
from layerplan.decoding.generate import generate
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.decoding.suffix_automaton import SuffixAutomaton
from tiny import ARCHS, tiny_model

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8]
tokens = st.lists(st.integers(0, 3), min_size=1, max_size=40)  # a small alphabet: many repeats


def brute_longest_repeat(text):
    """The longest suffix that occurs earlier followed by a token, and what follows it there."""
    n = len(text)
    for length in range(n - 1, 0, -1):
        suffix = text[n - length:]
        follow = Counter(text[i + length] for i in range(n - length) if text[i: i + length] == suffix)
        if follow:
            return length, follow
    return 0, Counter()


def occurrences_in(docs, pattern):
    return sum(doc[i: i + len(pattern)] == pattern for doc in docs for i in range(len(doc) - len(pattern) + 1))


@settings(derandomize=True, max_examples=150, deadline=None)
@given(tokens)
def test_automaton_grown_token_by_token_matches_brute_force(text):
    sam = SuffixAutomaton()
    for n, token in enumerate(text, 1):
        sam.extend(token)  # incremental: every check below runs after each append
        length, follow = brute_longest_repeat(text[:n])
        state, found = sam.longest_repeat()
        assert found == length
        if length:
            assert Counter(sam.continuations(state)) == follow
        else:
            assert state == 0
    for start in range(len(text)):
        for end in range(start + 1, min(len(text), start + 6) + 1):
            assert sam.occurrences(text[start:end]) == occurrences_in([text], text[start:end])
    assert sam.occurrences([99]) == 0
    bulk = SuffixAutomaton()
    bulk.extend_all(text)  # a bulk append counts once at the end: the same counts
    assert bulk.count == sam.count and bulk.next == sam.next
    assert len(sam.length) <= 2 * len(text) + 1  # linear size


@settings(derandomize=True, max_examples=100, deadline=None)
@given(st.lists(tokens, min_size=1, max_size=3), tokens)
def test_matching_a_new_text_against_separated_documents(docs, query):
    sam = SuffixAutomaton()
    for doc in docs:
        sam.extend_all(doc)
        sam.end_document()
    state, length = 0, 0
    for n, token in enumerate(query, 1):
        state, length = sam.match(state, length, token)
        seen = query[:n]
        best = max((k for k in range(1, n + 1) if occurrences_in(docs, seen[n - k:])), default=0)
        assert length == best  # no match runs across a document separator
        if best:
            suffix = seen[n - best:]
            follow = Counter(doc[i + best] for doc in docs for i in range(len(doc) - best)
                             if doc[i: i + best] == suffix)
            assert Counter(sam.continuations(state)) == follow
            assert sam.count[state] == occurrences_in(docs, suffix)


def propose(drafter, context, budget=8):
    return drafter.propose(DraftState(None, None, None, list(context), SamplingParams()), budget).tokens


def test_suffix_drafter_follows_the_most_frequent_continuation():
    # "1 2" is the longest repeated suffix: 3 follows twice, 4 once; "1 2 3 7 1 2" is followed by 3 once, 4 once
    context = [1, 2, 3, 7, 1, 2, 3, 7, 1, 2, 4, 9, 1, 2]
    assert propose(SuffixDrafter(min_share=0.6), context) == [3, 7, 1, 2]  # stops at the 1:1 split
    assert propose(SuffixDrafter(min_share=0.7), context) == []  # 3 holds 2 of the 3 continuations
    assert propose(SuffixDrafter(), context) == [3, 7, 1, 2, 3, 7, 1, 2]  # then its one occurrence
    assert propose(SuffixDrafter(max_tokens=2), context) == [3, 7]
    assert propose(SuffixDrafter(), context, budget=1) == [3]
    assert propose(SuffixDrafter(), [1, 2, 3]) == []  # nothing repeats


def test_suffix_drafter_grows_with_the_request_and_starts_over_on_a_new_one():
    drafter = SuffixDrafter(learn=True)
    first = [10, 11, 12, 13, 10, 11]
    assert propose(drafter, first) == [12, 13, 10, 11]
    automaton = drafter.request
    assert propose(drafter, first + [12, 40]) == []  # the same request: the automaton grew in place
    assert drafter.request is automaton and automaton.size == len(first) + 2
    # a new request: a fresh automaton; `learn` kept the first one's output (from its first pending token on)
    assert propose(drafter, [50, 11, 12]) == [40]
    assert drafter.request is not automaton and drafter.fed == [50, 11, 12]


def test_corpus_documents_and_the_longer_match_win():
    drafter = SuffixDrafter(corpus=[[1, 2, 3, 4, 5, 6], [7, 8, 9]])
    assert propose(drafter, [0, 2, 3]) == [4, 5, 6]  # the corpus, not past its document's end
    assert propose(drafter, [9, 7, 8]) == [9]
    # the request's own match [5, 1, 2] is longer than the corpus's [1, 2]
    assert propose(drafter, [5, 1, 2, 8, 8, 5, 1, 2]) == [8, 8, 5, 1, 2]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_speculative_with_suffix_drafts_equals_plain(arch):
    model = tiny_model(arch, num_layers=3)
    plain = generate(model, PROMPT, max_new_tokens=24, stop_at_eos=False).token_ids
    corpus = SuffixDrafter(corpus=[plain[:12], PROMPT + plain[:5]], name="suffix+corpus")  # some of it true
    for draft in ["suffix", "suffix:max=2,share=0.5", corpus]:
        for policy in ["fixed", "adaptive"]:
            result = generate(model, PROMPT, max_new_tokens=24, stop_at_eos=False, draft=draft, draft_length=policy)
            assert result.token_ids == plain, (draft, policy)
            assert result.stats["accepted"] <= result.stats["drafted"]
    assert generate(model, PROMPT, max_new_tokens=24, stop_at_eos=False, draft=corpus,
                    draft_length="fixed").stats["accepted"] > 0


def test_suffix_spec_errors_are_one_line_naming_the_file_or_option(tmp_path):
    model = tiny_model("llama", num_layers=2)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "ok.txt").write_text("some text")
    cases = {
        f"suffix:corpus={tmp_path / 'missing.txt'}": f"suffix corpus '{tmp_path / 'missing.txt'}': no such file",
        f"suffix:corpus={tmp_path}": "is a directory",
        f"suffix:corpus={tmp_path / 'latin1.txt'}": "latin1.txt' is not UTF-8 text",
        f"suffix:corpus={tmp_path / 'empty.txt'}": "empty.txt' holds no text",
        f"suffix:corpus={tmp_path / 'ok.txt'}": "has no tokenizer",  # tiny models come without one
        "suffix:max=x": "cannot read 'max=x' in 'suffix:max=x': expected suffix or suffix:corpus=FILE",
        "suffix:sharp=0.5": "cannot read 'sharp=0.5'",
        "suffix:max=0": "max >= 1",
        "suffix:share=2": r"in \[0, 1\]",
    }
    for spec, message in cases.items():
        with pytest.raises(ValueError, match=message) as error:
            make_drafter(spec, model)
        assert "\n" not in str(error.value)


@pytest.mark.real
def test_real_model_suffix_with_a_corpus_file_equals_plain(smollm2, tmp_path):
    prompt = "class Stack:\n    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n"
    ids = smollm2.encode(prompt)
    plain = generate(smollm2, ids, max_new_tokens=32).token_ids
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(prompt + smollm2.tokenizer.decode(plain))
    for draft in ["suffix", f"suffix:corpus={corpus}"]:
        result = generate(smollm2, ids, max_new_tokens=32, draft=draft, draft_length="fixed")
        assert result.token_ids == plain, draft
    assert result.stats["acceptance_rate"] > 0.5  # the corpus holds the answer

"""A suffix automaton over token sequences, grown one token at a time, with occurrence counts.

The automaton of a text T has one state per class of substrings that end at the same set of
positions (their *endpos*), at most 2|T| states; `count[v]` = |endpos(v)| = how often the
substrings of v occur in T. Appending a token is Blumer et al.'s online construction (amortised
O(1) transitions) plus one increment per state on the new end's suffix-link chain, which keeps
the counts exact without any rebuild (the chain is short for ordinary text and grows with the
length of a verbatim repeat). A bulk append (`extend_all` of more tokens than T holds, e.g. a
corpus file) skips the increments and recounts every state once, in O(|T|), instead.

Several documents share one automaton: `end_document()` appends a separator (a negative id of its
own, never matched by a token), so that no match runs across documents.

What the suffix drafter asks of it:
- `match(state, length, token)`: the longest suffix of a sequence that occurs in T, kept up to
  date token by token (for text that is not in T, e.g. a corpus matched against a new request);
- `longest_repeat()`: the longest suffix of T that also occurs earlier, followed by a token;
- `with_continuation(state)`: back off from a match to its longest suffix that a token follows;
- `continuations(state)`: the tokens that follow a state's occurrences, with their counts.
"""

from __future__ import annotations


class SuffixAutomaton:
    def __init__(self) -> None:
        self.length: list[int] = [0]  # longest substring of each state
        self.link: list[int] = [-1]  # suffix link: the state of the longest suffix in another class
        self.next: list[dict[int, int]] = [{}]  # transitions: token -> state
        self.count: list[int] = [0]  # |endpos|: occurrences of the state's substrings
        self.own: list[bool] = [False]  # the state was made for a new end position (not a clone)
        self.last = 0  # the state of the whole text
        self.size = 0  # tokens appended (separators included)
        self._separator = -1

    def _new_state(self, length: int, link: int, transitions: dict[int, int], count: int) -> int:
        self.length.append(length)
        self.link.append(link)
        self.next.append(transitions)
        self.count.append(count)
        self.own.append(False)
        return len(self.length) - 1

    def extend(self, token: int, count: bool = True) -> None:
        """Append one token to T (count=False: leave the counts to a `recount()` after a bulk append)."""
        length, link, nxt = self.length, self.link, self.next
        cur = self._new_state(length[self.last] + 1, 0, {}, 0)
        self.own[cur] = True
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # q also holds longer strings that do not end here: split off its short part
                clone = self._new_state(length[p] + 1, link[q], dict(nxt[q]), self.count[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur
        self.size += 1
        state = cur if count else 0  # every suffix of the new text occurs once more
        while state > 0:
            self.count[state] += 1
            state = link[state]

    def extend_all(self, tokens) -> None:
        tokens = list(tokens)
        bulk = len(tokens) > self.size
        for token in tokens:
            self.extend(token, count=not bulk)
        if bulk:
            self.recount()

    def recount(self) -> None:
        """Every count from scratch: one per end position, summed up the suffix-link tree
        (longest states first), O(|T|)."""
        by_length: list[list[int]] = [[] for _ in range(self.size + 1)]
        for state in range(1, len(self.length)):
            by_length[self.length[state]].append(state)
        count, link = self.count, self.link
        for state in range(len(count)):
            count[state] = int(self.own[state])
        for states in reversed(by_length):
            for state in states:
                if link[state] > 0:
                    count[link[state]] += count[state]

    def end_document(self) -> None:
        """Close the current document: nothing matches across the separator."""
        self.extend(self._separator)
        self._separator -= 1

    def match(self, state: int, length: int, token: int) -> tuple[int, int]:
        """The longest suffix of (matched text + token) that occurs in T, as (state, length), from
        the longest suffix of the matched text (state, length); (0, 0) is the empty match."""
        nxt, link = self.next, self.link
        while state and token not in nxt[state]:
            state = link[state]
            length = self.length[state]
        if token in nxt[state]:
            return nxt[state][token], length + 1
        return 0, 0

    def longest_repeat(self) -> tuple[int, int]:
        """(state, length) of the longest suffix of T that occurs earlier in T too, followed by a
        token; (0, 0) when none does."""
        return self.with_continuation(self.last)

    def with_continuation(self, state: int) -> tuple[int, int]:
        """The longest suffix of the state's strings that some token (not a separator) follows
        somewhere in T, as (state, length); (0, 0) when none."""
        while state > 0 and not any(token >= 0 for token in self.next[state]):
            state = self.link[state]
        return (state, self.length[state]) if state > 0 else (0, 0)

    def continuations(self, state: int) -> dict[int, int]:
        """token -> occurrences of (the state's substrings + token); separators left out."""
        return {token: self.count[target] for token, target in self.next[state].items() if token >= 0}

    def occurrences(self, tokens) -> int:
        """How often `tokens` occurs in T (0 if never)."""
        state = 0
        for token in tokens:
            state = self.next[state].get(token, -1)
            if state < 0:
                return 0
        return self.count[state] if state else self.size + 1

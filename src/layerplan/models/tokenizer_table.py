"""A BPE tokenizer read in the part a text needs: what a later start parses instead of the whole
tokenizer.json.

`tokenizers` builds a BPE model from the whole vocabulary and merge list (0.66 s for Gemma 3's
262,144 tokens and 514,906 merges, 0.1 s for SmolLM2's 49,152), most of a later start of a small
model. A text's encoding needs far less. Invariant (what makes the part exact): every symbol of a
word during BPE is a vocabulary token made of that word's characters, or a byte-fallback token,
or the unknown token, or a merge's result of two such symbols; so a model holding

    S = {tokens whose characters all occur in the text's pipeline} ∪ byte tokens ∪ <unk> ∪ added tokens,
        closed under "both parts in S -> the merge's result in S",

and the merges among S in their order (rank order kept, so every choice between two merges is the
whole model's), encodes the text exactly as the whole model does. The characters are those each of
the text's characters becomes alone through the normalizer and pre-tokenizer (which map each
character alone: _character_local), and those of "a" and " a" (what a pre-tokenizer prepends:
ByteLevel's "Ġ", Metaspace's "▁").

Decoding needs no model: each id's token (the added vocabulary's first), special tokens left out
where asked, then the tokenizer's own decoder, as tokenizers' TokenizerImpl::decode does.

The table (TOKENIZER_TABLE_FILE, beside tokenizer.json in the index) holds the vocabulary as
UTF-8 with offsets, each token's distinct characters (postings by character), the merges as id
triples and the tokenizer.json without its vocabulary and merges (the "frame"). The index writer
keeps it with a large tokenizer.json (models/file_index.py); a reader makes it where it is absent or
of another tokenizer.json. Tokenizers it does not cover (not BPE, dropout, subword prefixes or
suffixes, a normalizer or pre-tokenizer that does not map each character alone, an added token
outside the vocabulary) have an empty one: their tokenizer.json is parsed whole.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from layerplan.files import write_bytes_atomic
from layerplan.heap import collector_paused
from layerplan.models.gguf_place import TOKENIZER_TABLE_FILE

TABLE_VERSION = 1
_BPE_OPTIONS = ("unk_token", "fuse_unk", "byte_fallback", "ignore_merges")


def _source_stamp(path: Path) -> np.ndarray:
    stat = path.stat()
    return np.array([TABLE_VERSION, stat.st_size, stat.st_mtime_ns], np.int64)


def _character_local(step: dict | None, kinds: dict) -> bool:
    """Whether a normalizer or pre-tokenizer maps a text to characters that each of its characters
    alone maps to (with what it prepends): the kinds the index writes (models/file_index.py)."""
    if step is None:
        return True
    kind = step.get("type")
    if kind == "Sequence":
        return all(_character_local(part, kinds) for part in step.get("normalizers", step.get("pretokenizers", [])))
    check = kinds.get(kind)
    return check is not None and check(step)


_LOCAL_NORMALIZERS = {"Replace": lambda step: len(step.get("pattern", {}).get("String", "")) == 1,
                      "Prepend": lambda step: True}
# (Split and the others cut the text; ByteLevel and Metaspace respell each character alone)
_LOCAL_PRE_TOKENIZERS = {kind: (lambda step: True) for kind in ("ByteLevel", "Metaspace", "Split", "Whitespace",
                                                                  "WhitespaceSplit", "Digits", "Punctuation")}


def _build(tokenizer_json: dict) -> dict[str, np.ndarray] | None:
    """The table's arrays for a tokenizer.json's contents; None where it does not cover the tokenizer."""
    model = tokenizer_json.get("model") or {}
    if not (_character_local(tokenizer_json.get("normalizer"), _LOCAL_NORMALIZERS)
            and _character_local(tokenizer_json.get("pre_tokenizer"), _LOCAL_PRE_TOKENIZERS)):
        return None
    if (model.get("type") != "BPE" or model.get("dropout") is not None
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix")):
        return None
    vocab: dict[str, int] = model.get("vocab") or {}
    if not vocab:
        return None
    added = tokenizer_json.get("added_tokens") or []
    if any(vocab.get(token.get("content")) != token.get("id") for token in added):
        return None  # (its id comes from the whole vocabulary's size: the part would give another)
    size = max(vocab.values()) + 1
    words = [""] * size
    for word, token_id in vocab.items():
        words[token_id] = word
    present = np.zeros(size, bool)
    present[np.fromiter(vocab.values(), np.int64, len(vocab))] = True
    merges = model.get("merges") or []
    try:
        if all(isinstance(merge, str) for merge in merges):  # "a b": one space each (tokenizers' rule)
            parts = " ".join(merges).split(" ")
            if len(parts) != 2 * len(merges):
                return None
            firsts, seconds = parts[0::2], parts[1::2]
        else:
            firsts, seconds = [a for a, _ in merges], [b for _, b in merges]
        left = np.array([vocab[a] for a in firsts], np.int32)
        right = np.array([vocab[b] for b in seconds], np.int32)
        result = np.array([vocab[a + b] for a, b in zip(firsts, seconds)], np.int32)
    except (KeyError, ValueError, TypeError):
        return None  # (tokenizers refuses it too: the whole parse says how)
    encoded = [word.encode() for word in words]
    word_offsets = np.zeros(size + 1, np.int64)
    word_offsets[1:] = np.cumsum(np.fromiter(map(len, encoded), np.int64, size))
    # each token's distinct characters, and for each character the tokens holding it: keys
    # (character, token), sorted, each once
    lengths = np.fromiter(map(len, words), np.int64, size)
    codepoints = np.frombuffer("".join(words).encode("utf-32-le"), np.uint32).astype(np.int64)
    keys = np.sort((codepoints << 32) | np.repeat(np.arange(size, dtype=np.int64), lengths))
    keys = keys[np.append(True, keys[1:] != keys[:-1])]  # (np.unique: its hashing is 10x slower here)
    characters, holders = keys >> 32, (keys & 0xFFFFFFFF).astype(np.int32)
    alphabet, starts = np.unique(characters, return_index=True)
    postings_offsets = np.append(starts, len(characters)).astype(np.int64)
    distinct = np.bincount(holders, minlength=size).astype(np.int32)
    always = {token["id"] for token in added}
    always |= {vocab[byte] for byte in (f"<0x{b:02X}>" for b in range(256)) if byte in vocab}  # (byte fallback's)
    if model.get("unk_token") in vocab:
        always.add(vocab[model["unk_token"]])
    frame = dict(tokenizer_json)
    frame["model"] = dict(model, vocab={words[i]: i for i in sorted(always)}, merges=[])
    return {"words": np.frombuffer(b"".join(encoded), np.uint8), "word_offsets": word_offsets,
            "present": present, "distinct": distinct, "alphabet": alphabet.astype(np.int32),
            "postings": holders, "postings_offsets": postings_offsets, "left": left, "right": right,
            "result": result, "always": np.array(sorted(always), np.int32),
            "frame": np.frombuffer(json.dumps(frame).encode(), np.uint8)}


def _read(path: Path, stamp: np.ndarray) -> dict[str, np.ndarray] | None:
    """The kept table's arrays (none, {}, for a tokenizer it does not cover); None where it is
    absent, unreadable or of another tokenizer.json."""
    try:
        with np.load(path) as kept:
            arrays = {name: kept[name] for name in kept.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile):
        return None
    if not np.array_equal(arrays.pop("stamp", None), stamp):
        return None
    return arrays


def write_table(index: Path, tokenizer_json: dict) -> dict[str, np.ndarray]:
    """Keep the table of the index's tokenizer.json, whose contents are `tokenizer_json` (an empty
    one where it does not cover the tokenizer: not looked at again), atomically; its arrays. An
    index it cannot be written to is left without (it is made again at the next read)."""
    with collector_paused():  # (millions of new strings and lists)
        arrays = _build(tokenizer_json) or {}
    buffer = io.BytesIO()
    np.savez(buffer, stamp=_source_stamp(index / "tokenizer.json"), **arrays)
    try:
        write_bytes_atomic(index / TOKENIZER_TABLE_FILE, buffer.getvalue())
    except OSError:  # (a read-only index)
        pass
    return arrays


class PartialTokenizer:
    """tokenizers.Tokenizer's encode, decode and token_to_id for a BPE tokenizer, from the table:
    encode by the part of the model the texts so far need (made again when a text brings a character
    the part was not made for), decode without a model."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self._arrays = arrays
        self._words, self._word_offsets = arrays["words"].tobytes(), arrays["word_offsets"]
        self._present = arrays["present"]
        # (here: models/file_index.py, which writes the table, is imported by every start of the light
        # front end, and those whose tokenizer runs in a process of its own never build one)
        from tokenizers import Tokenizer, models

        self._bpe = models.BPE
        frame = json.loads(arrays["frame"].tobytes())
        self._options = {name: frame["model"][name] for name in _BPE_OPTIONS if frame["model"].get(name) is not None}
        self._tokenizer = Tokenizer.from_str(json.dumps(frame))
        self._normalizer, self._pre_tokenizer = self._tokenizer.normalizer, self._tokenizer.pre_tokenizer
        self._decoder = self._tokenizer.decoder
        self._added = {token["id"]: token["content"] for token in frame.get("added_tokens") or []}
        self._special = {token["content"] for token in frame.get("added_tokens") or [] if token.get("special")}
        # the characters the part is made for: those of the texts covered (_raw) through the
        # pipeline, and what the pipeline adds to a text (a prefix "Ġ" or "▁")
        self._raw: set[str] = set()
        self._characters = self._pipeline_characters("a") | self._pipeline_characters(" a")
        self._made = False  # (the part is made at the first _cover)

    @classmethod
    def of_index(cls, index: Path) -> PartialTokenizer | None:
        """The index's tokenizer from its table (made now where absent or stale); None where the
        table does not cover it (then tokenizer.json is parsed whole)."""
        source = index / "tokenizer.json"
        arrays = _read(index / TOKENIZER_TABLE_FILE, _source_stamp(source))
        if arrays is None:
            arrays = write_table(index, json.loads(source.read_text()))
        return cls(arrays) if arrays else None

    def _word(self, token_id: int) -> str:
        return self._words[self._word_offsets[token_id]:self._word_offsets[token_id + 1]].decode()

    def _pipeline_characters(self, text: str) -> set[str]:
        normalized = self._normalizer.normalize_str(text) if self._normalizer is not None else text
        pieces = (self._pre_tokenizer.pre_tokenize_str(normalized) if self._pre_tokenizer is not None
                  else [(normalized, None)])
        return set(text) | set(normalized) | {c for piece, _ in pieces for c in piece}

    def _cover(self, text: str) -> None:
        """Make the part cover `text` (see the module's invariant), where it does not yet."""
        new = set(text) - self._raw
        if not new and self._made:
            return
        characters = set(self._characters)
        for character in new:  # (the pipeline is character-local: _build checks it)
            characters |= self._pipeline_characters(character)
        self._raw |= new
        if characters == self._characters and self._made:
            return
        table = self._arrays
        codepoints = np.array(sorted(ord(c) for c in characters), np.int32)
        found = np.searchsorted(table["alphabet"], codepoints[np.isin(codepoints, table["alphabet"])])
        offsets = table["postings_offsets"]
        holders = [table["postings"][offsets[k]:offsets[k + 1]] for k in found.tolist()]
        counts = np.bincount(np.concatenate(holders) if holders else np.zeros(0, np.int32),
                             minlength=len(self._present))
        part = (counts == table["distinct"]) & self._present
        part[table["always"]] = True
        left, right, result = table["left"], table["right"], table["result"]
        while True:  # the closure under merges (byte tokens' merges, whose results hold "<0x")
            usable = part[left] & part[right]
            grown = part.copy()
            grown[result[usable]] = True
            if np.array_equal(grown, part):
                break
            part = grown
        merges = np.flatnonzero(usable)
        vocab = {self._word(i): i for i in np.flatnonzero(part).tolist()}
        merge_pairs = [(self._word(a), self._word(b)) for a, b in zip(left[merges].tolist(), right[merges].tolist())]
        self._tokenizer.model = self._bpe(vocab=vocab, merges=merge_pairs, **self._options)
        self._characters, self._made = characters, True

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._cover(text)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        tokens = []
        for token_id in ids:
            if token_id.__index__() >= 1 << 32 or token_id < 0:  # (a u32, as tokenizers takes ids)
                raise OverflowError(f"number too {'large' if token_id > 0 else 'small'} to fit in target type")
            token = self._added.get(token_id)
            if token is None and 0 <= token_id < len(self._present) and self._present[token_id]:
                token = self._word(token_id)
            if token is not None and not (skip_special_tokens and token in self._special):
                tokens.append(token)
        return self._decoder.decode(tokens) if self._decoder is not None else " ".join(tokens)

    def token_to_id(self, token: str) -> int | None:
        self._cover(token)
        return self._tokenizer.token_to_id(token)

"""A BPE tokenizer read in the part each text needs (models/tokenizer_table.py): the cases the
index's own tokenizers do not reach (tests/test_file_index.py _same_in_part checks those): merges
of byte-fallback tokens, a table kept from another tokenizer.json, tokenizers it leaves whole."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from layerplan.models.gguf_place import TOKENIZER_TABLE_FILE as TABLE_FILE
from layerplan.models.tokenizer_table import PartialTokenizer


def _saved(tokenizer: Tokenizer, folder: Path) -> Path:
    folder.mkdir(exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def _byte_fallback_tokenizer() -> Tokenizer:
    """SentencePiece-style: "é" is not a token, its UTF-8 bytes are, and a merge joins them (so the
    merge's result holds no character of the text: only the closure under merges brings it in)."""
    vocab = {"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "<0xC3><0xA9>": 3, "\u2581": 4, "a": 5, "\u2581a": 6, "b": 7}
    merges = [("<0xC3>", "<0xA9>"), ("\u2581", "a")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer


def test_a_merge_of_byte_tokens_is_kept_in_the_part(tmp_path):
    whole = _byte_fallback_tokenizer()
    assert 3 in whole.encode("é").ids  # (the bytes' merge applies)
    part = PartialTokenizer.of_index(_saved(whole, tmp_path / "index"))
    for text in ("é", "a é b", " aé", "b"):
        assert part.encode(text) == whole.encode(text).ids, text
    assert part.decode(whole.encode("a é b").ids) == whole.decode(whole.encode("a é b").ids)


def test_a_table_of_another_tokenizer_json_is_made_again(tmp_path):
    index = _saved(_byte_fallback_tokenizer(), tmp_path / "index")
    assert PartialTokenizer.of_index(index).encode("a") == [6]
    kept = (index / TABLE_FILE).stat().st_mtime_ns
    data = json.loads((index / "tokenizer.json").read_text())
    data["model"]["vocab"]["\u2581a"], data["model"]["vocab"]["b"] = 7, 6  # the same size, other ids
    (index / "tokenizer.json").write_text(json.dumps(data))
    os.utime(index / "tokenizer.json", ns=(kept + 10**9, kept + 10**9))
    assert PartialTokenizer.of_index(index).encode("a") == Tokenizer.from_file(str(index / "tokenizer.json")).encode("a").ids == [7]


def test_an_index_the_table_cannot_be_written_to_is_read_without_it(tmp_path, monkeypatch):
    from layerplan.models import tokenizer_table

    def refuse(path, data):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(tokenizer_table, "write_bytes_atomic", refuse)
    index = _saved(_byte_fallback_tokenizer(), tmp_path / "index")
    assert PartialTokenizer.of_index(index).encode("a b") == _byte_fallback_tokenizer().encode("a b").ids
    assert not (index / TABLE_FILE).exists()


def _word_piece() -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def _composing() -> Tokenizer:
    tokenizer = _byte_fallback_tokenizer()
    tokenizer.normalizer = normalizers.NFC()  # (it joins characters: each alone does not say what a text becomes)
    return tokenizer


def _added_outside() -> Tokenizer:
    tokenizer = _byte_fallback_tokenizer()
    tokenizer.add_special_tokens(["<extra>"])  # (its id follows the whole vocabulary's size)
    return tokenizer


@pytest.mark.parametrize("make", [_word_piece, _composing, _added_outside], ids=["wordpiece", "nfc", "added-outside"])
def test_a_tokenizer_the_table_does_not_cover_is_left_whole(make, tmp_path):
    index = _saved(make(), tmp_path / "index")
    assert PartialTokenizer.of_index(index) is None
    assert (index / TABLE_FILE).exists()  # (an empty table: the next start does not look again)
    assert PartialTokenizer.of_index(index) is None


def test_a_table_cut_short_is_made_again(tmp_path):
    index = _saved(_byte_fallback_tokenizer(), tmp_path / "index")
    PartialTokenizer.of_index(index)
    table = index / TABLE_FILE
    table.write_bytes(table.read_bytes()[:100])
    assert PartialTokenizer.of_index(index).encode("a é") == _byte_fallback_tokenizer().encode("a é").ids
    assert table.stat().st_size > 100

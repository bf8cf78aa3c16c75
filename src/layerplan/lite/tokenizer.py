"""A GGUF index's tokenizer as the light front end reads it (transformers' answers), in this
process (LiteTokenizer) or in a process of its own started at the command's start
(lite/tokenizer_process.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from layerplan.models.errors import ModelError
from layerplan.models.gguf_place import PARTIAL_TOKENIZER_BYTES


class LiteTokenizer:
    """The index's tokenizer.json through the `tokenizers` package, as transformers' tokenizer
    (transformers 5's TokenizersBackend) reads it: encode adds the special tokens its
    post-processor adds; decode skips special tokens and, where tokenizer_config.json asks, cleans
    up spaces as transformers does. A tokenizer.json of PARTIAL_TOKENIZER_BYTES or more is read
    from its table in the part each text needs (models/tokenizer_table.py), where the table covers it."""

    def __init__(self, index: Path) -> None:
        path = index / "tokenizer.json"
        self._partial = None
        try:
            if path.stat().st_size >= PARTIAL_TOKENIZER_BYTES:
                # a large BPE tokenizer from its table, in the part each text needs (imported here:
                # it needs numpy, whose import a small tokenizer's process would only wait for)
                from layerplan.models.tokenizer_table import PartialTokenizer

                self._partial = PartialTokenizer.of_index(index)
            if self._partial is None:
                # (here: a command whose tokenizer runs in a process of its own, lite/tokenizer_process.py,
                # imports this module for the class and never parses one itself)
                from tokenizers import Tokenizer

                self._tokenizer = Tokenizer.from_file(str(path))
            else:
                self._tokenizer = self._partial
        except Exception as error:  # (tokenizers raises its parse errors as Exception)
            raise ModelError(f"{path}: {error}") from None
        try:
            config = json.loads((index / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            config = {}
        # transformers skips the clean-up for a BPE model unless told to corrupt its output anyway
        bpe = self._partial is not None or type(self._tokenizer.model).__name__ == "BPE"
        self.clean_up = bool(config.get("clean_up_tokenization_spaces", False)) and (
            not bpe
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")))
        eos = config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        eos_id = self._tokenizer.token_to_id(eos) if isinstance(eos, str) else None
        self.eos_ids = (eos_id,) if eos_id is not None else ()

    def ready(self) -> LiteTokenizer:
        """Itself: read whole when made (as TokenizerProcess.ready once its process has read it)."""
        return self

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        if self._partial is not None:
            return self._partial.encode(text, add_special_tokens=special_tokens)
        return self._tokenizer.encode(text, add_special_tokens=special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return clean_up_spaces(text) if self.clean_up else text


def clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization: a space before punctuation and English contractions dropped."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text

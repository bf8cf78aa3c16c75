"""A GGUF's index made from the file alone (models/file_index.py, issue 47) against the index
transformers makes (models/stored.py index_gguf): the same config dict, tensor names, row orders
and chat frame; the same tokenizer (its tokenizer.json, and the ids and text of a corpus); rotary
frequencies within one float32 step of transformers'; and a first start that makes it imports
neither torch nor transformers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from layerplan.files import cache_dir
from layerplan.models.file_index import file_index_refusal, write_file_index
from layerplan.models.gguf_file import read_header
from layerplan.models.gguf_place import INDEX_VERSION, TENSORS_FILE, default_gguf_path
from tiny import tiny_hf
from tiny_gguf import ARCHITECTURES, write_tiny_gguf

CORPUS = ((Path(__file__).parents[1] / "README.md").read_text()
          + "\n  two  spaces,\ttabs\r\n wörds, 你好, 🙂 <|im_start|>x<|im_end|> 12345 don't I'LL")


def _both(path: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(the index made from the file, the index transformers makes) of one GGUF."""
    from layerplan.models.stored import index_gguf

    header = read_header(path)
    assert file_index_refusal(header) is None
    ours = write_file_index(header, tmp_path / "ours", INDEX_VERSION, TENSORS_FILE)
    return ours, index_gguf(path, tmp_path / "theirs")


def _facts(index: Path) -> dict:
    return json.loads((index / TENSORS_FILE).read_text())


def _same_rotary(ours: dict, theirs: dict) -> None:
    """Two rotary tables ({"inv_freq", "attention_scaling"}), within one float32 step: transformers'
    come from torch's vectorised pow."""
    mine, reference = (np.asarray(table["inv_freq"], np.float32) for table in (ours, theirs))
    steps = np.abs(mine.view(np.int32) - reference.view(np.int32))
    assert mine.shape == reference.shape and steps.max() <= 1
    assert ours["attention_scaling"] == theirs["attention_scaling"]


def _same_rotary_by_layer_type(ours: Path, theirs: Path) -> None:
    """Two indexes' rotary tables of each layer type (Gemma 3's), within one float32 step each."""
    mine, reference = (_facts(index)["rotary"]["by_layer_type"] for index in (ours, theirs))
    assert set(mine) == set(reference) and "sliding_attention" in mine
    for kind in mine:
        _same_rotary(mine[kind], reference[kind])


def _same_config(ours: Path, theirs: Path) -> None:
    """Our config.json is the one transformers writes, but for the version it stamps."""
    mine, reference = (json.loads((index / "config.json").read_text()) for index in (ours, theirs))
    reference.pop("transformers_version")
    assert mine == reference


def _real_file(name: str) -> Path:
    """A real GGUF of the folder LAYERPLAN_REAL_MODELS names (real_models.sh fills it, `make
    bench-real` sets it); the test skips where it is not there."""
    path = Path(os.environ.get("LAYERPLAN_REAL_MODELS") or "/nonexistent") / name
    if not path.exists():
        pytest.skip(f"LAYERPLAN_REAL_MODELS does not name a folder with the real {name}")
    return path


@pytest.mark.parametrize("arch", sorted({"llama", "qwen2", "qwen3"} & set(ARCHITECTURES)))  # (tiny "mistral" is a llama file)
def test_a_tiny_files_index_is_the_one_transformers_makes(arch, tmp_path):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = write_tiny_gguf(tiny_hf(arch), tmp_path / f"{arch}.gguf", "Q4_0" if arch == "qwen2" else "Q8_0")
    ours, theirs = _both(path, tmp_path)
    assert _facts(ours)["tensors"] == _facts(theirs)["tensors"]  # names, types, offsets, row orders
    assert _facts(ours)["chat"] == _facts(theirs)["chat"] == {"template": False}
    if arch == "qwen3":  # transformers reads no key length for Qwen3 (its config's 128); ours, the file's 16
        assert len(_facts(ours)["rotary"]["inv_freq"]) == 8
    else:
        _same_rotary(_facts(ours)["rotary"], _facts(theirs)["rotary"])
    expected = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    assert json.loads((ours / "config.json").read_text()) == expected
    assert not (ours / "tokenizer.json").exists()  # a file without a vocabulary: a model of token ids


def test_a_tiny_gemma3_files_index_is_the_one_transformers_makes(tmp_path):
    """Gemma 3: its four norms a layer (shifted by -1, as transformers' processor reads them), q/k
    norms, a full config.json (layer types, each type's rotary base) and two rotary tables."""
    path = write_tiny_gguf(tiny_hf("gemma3_text"), tmp_path / "gemma3.gguf", "Q8_0")
    ours, theirs = _both(path, tmp_path)
    assert _facts(ours)["tensors"] == _facts(theirs)["tensors"]
    assert {e["shift"] for e in _facts(ours)["tensors"] if not e["matrix"]} == {-1.0}
    _same_rotary_by_layer_type(ours, theirs)
    _same_config(ours, theirs)


def _tokenizer_json(index: Path) -> dict:
    data = json.loads((index / "tokenizer.json").read_text())
    merges = data["model"].get("merges") or []
    data["model"]["merges"] = [m.split(" ") if isinstance(m, str) else m for m in merges]
    return data


def _same_tokenizer(ours: Path, path: Path) -> None:
    """Ours, as the torch front end loads it from the index, against transformers' tokenizer of
    the GGUF itself: the same ids for the corpus, with and without special tokens, and the same text back."""
    from transformers import AutoTokenizer

    mine, reference = AutoTokenizer.from_pretrained(ours), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for special in (True, False):
        ids = mine(CORPUS, add_special_tokens=special)["input_ids"]
        assert ids == reference(CORPUS, add_special_tokens=special)["input_ids"]
        for skip in (True, False):
            assert mine.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert (mine.bos_token, mine.eos_token, mine.pad_token) == (reference.bos_token, reference.eos_token,
                                                                reference.pad_token)


def _same_in_part(index: Path) -> None:
    """The index's tokenizer read in the part each text needs (models/tokenizer_table.py) answers as
    the whole tokenizer.json does: the corpus's lines one by one (the part grown as characters come),
    then the corpus whole and random strings of its characters and the added tokens from a part
    read back from the kept table; random ids decoded, special tokens skipped or not, ids past the
    vocabulary among them; each added token's id."""
    import random

    from tokenizers import Tokenizer

    from layerplan.models.tokenizer_table import PartialTokenizer

    whole = Tokenizer.from_file(str(index / "tokenizer.json"))
    added = [token.content for token in whole.get_added_tokens_decoder().values()]
    rng = random.Random(0)
    alphabet = sorted(set(CORPUS)) + ["\u00e9", "\U0001f642", "\x00"] + added[:20]
    texts = [*CORPUS.splitlines()[:60], CORPUS] + ["".join(rng.choices(alphabet, k=rng.randrange(1, 30)))
                                                   for _ in range(100)]
    for fresh in (True, False):  # (a part grown text by text, then one read back from the kept table)
        part = PartialTokenizer.of_index(index)
        assert part is not None
        for text in (texts if fresh else texts[::-1]):
            for special in (True, False):
                assert part.encode(text, special) == whole.encode(text, add_special_tokens=special).ids, text
    size = whole.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(size + 3) for _ in range(rng.randrange(12))]
        for skip in (True, False):
            assert part.decode(ids, skip) == whole.decode(ids, skip_special_tokens=skip), ids
    for token in added + ["the", "\u0120the", "\u2581the"]:
        assert part.token_to_id(token) == whole.token_to_id(token), token


def test_the_packaged_models_index_is_the_one_transformers_makes(tmp_path):
    """SmolLM2: a byte-level BPE vocabulary of 49,152 tokens, its merges, control tokens and chat template."""
    path = default_gguf_path()
    ours, theirs = _both(path, tmp_path)
    assert _facts(ours)["tensors"] == _facts(theirs)["tensors"]
    assert _facts(ours)["chat"] == _facts(theirs)["chat"] and "prefix" in _facts(ours)["chat"]
    _same_rotary(_facts(ours)["rotary"], _facts(theirs)["rotary"])
    assert _tokenizer_json(ours) == _tokenizer_json(theirs)
    _same_tokenizer(ours, path)
    _same_in_part(ours)


def _rewritten(path: Path, target: Path, add_vocabulary, rows: int | None = None) -> Path:
    """The tiny GGUF at `path` written again to `target`: its keys but its tokenizer's, which
    add_vocabulary(writer) writes, and its tensors (rows: the embedding's and head's rows, one a
    token of the new vocabulary, where it changes their count)."""
    import gguf

    tiny = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(target), "llama")
    for key, field in tiny.fields.items():
        if key.startswith(("GGUF.", "tokenizer.")) or key == "general.architecture" or (
                rows is not None and key == "llama.vocab_size"):
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, kind)
    add_vocabulary(writer)
    for tensor in tiny.tensors:
        data = np.asarray(tensor.data)
        if rows is not None and tensor.name in ("token_embd.weight", "output.weight"):
            data = np.resize(data, (rows, *data.shape[1:]))
        writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def _with_vocabulary(path: Path, target: Path, changes: dict, size: int = 3000) -> Path:
    """The tiny GGUF at `path` with the first `size` tokens of the packaged model's vocabulary
    (its special tokens among them), the merges among those, its chat template, and `changes` to
    its tokenizer keys (the pre-tokenizer's name, BOS, token types)."""
    source = dict(read_header(default_gguf_path()).metadata)
    tokens = source["tokenizer.ggml.tokens"][:size]
    kept = set(tokens)
    source["tokenizer.ggml.tokens"] = tokens
    source["tokenizer.ggml.token_type"] = np.asarray(source["tokenizer.ggml.token_type"])[:size]
    source["tokenizer.ggml.merges"] = [m for m in source["tokenizer.ggml.merges"]
                                       if all(part in kept for part in (*m.split(" "), m.replace(" ", "")))]
    types = np.asarray(source["tokenizer.ggml.token_type"]).astype(np.int32)
    for index, kind in changes.get("types", {}).items():
        types[index] = kind

    def add_vocabulary(writer) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(changes.get("pre", "smollm"))
        writer.add_token_list(source["tokenizer.ggml.tokens"])
        writer.add_token_types(types.tolist())
        writer.add_token_merges(source["tokenizer.ggml.merges"])
        writer.add_bos_token_id(int(source["tokenizer.ggml.bos_token_id"]))
        writer.add_eos_token_id(int(source["tokenizer.ggml.eos_token_id"]))
        if "add_bos" in changes:
            writer.add_add_bos_token(changes["add_bos"])
        writer.add_chat_template(changes.get("template", source["tokenizer.chat_template"]))

    return _rewritten(path, target, add_vocabulary)


@pytest.mark.parametrize("changes", [
    {"pre": "llama-bpe", "add_bos": True},  # Llama 3's split, a BOS added to every text
    {"pre": "qwen2", "types": {2000: 4, 7: 4}},  # Qwen2's split; user-defined tokens, matched whole
    {"pre": "gpt-4o", "add_bos": False,
     "template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"},
], ids=["llama3-bos", "qwen2-user-defined", "gpt4o-bos-in-template"])
def test_byte_level_vocabularies_tokenize_as_transformers_converter_does(changes, tmp_path):
    tiny = write_tiny_gguf(tiny_hf("llama"), tmp_path / "tiny.gguf")
    (tmp_path / "vocab").mkdir()  # (a folder of one GGUF: transformers reads it by folder and name)
    path = _with_vocabulary(tiny, tmp_path / "vocab" / "model.gguf", changes)
    ours, theirs = _both(path, tmp_path)
    assert _tokenizer_json(ours) == _tokenizer_json(theirs)
    assert _facts(ours)["chat"] == _facts(theirs)["chat"]
    _same_tokenizer(ours, path)
    _same_in_part(ours)


def _sentencepiece_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece vocabulary as llama.cpp writes one (tokens, scores, token types): <unk>,
    <s>, </s>, the 256 byte tokens, the corpus's characters, then "▁word" pieces of its words with
    every prefix of each, scored by rank (no merges: they come from the scores)."""
    from collections import Counter

    tokens, types = ["<unk>", "<s>", "</s>"], [2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["\u2581"] + sorted({c for c in CORPUS if not c.isspace()})
    words = Counter("\u2581" + w for w in CORPUS.split() if w.isalpha())
    for word, _ in words.most_common(300):
        pieces += [word[:end] for end in range(2, len(word) + 1)]
    pieces = list(dict.fromkeys(p for p in pieces if p not in tokens))
    tokens += pieces
    types += [1] * len(pieces)
    scores = [0.0] * 259 + [-float(rank) for rank in range(len(pieces))]
    return tokens, scores, types


def _with_sentencepiece(path: Path, target: Path, changes: dict) -> Path:
    """The tiny GGUF at `path` with _sentencepiece_vocabulary and `changes` (BOS flag, token types)."""
    tokens, scores, types = _sentencepiece_vocabulary()
    for index, kind in changes.get("types", {}).items():
        types[index] = kind

    def add_vocabulary(writer) -> None:
        writer.add_vocab_size(len(tokens))
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        if "add_bos" in changes:
            writer.add_add_bos_token(changes["add_bos"])

    return _rewritten(path, target, add_vocabulary, rows=len(tokens))


@pytest.mark.parametrize("changes", [
    {},  # llama.cpp's default: BOS added
    {"add_bos": False, "types": {300: 4, 3: 3}},  # no BOS; a user-defined piece matched whole, a byte as control
], ids=["bos", "no-bos-user-defined"])
def test_sentencepiece_vocabularies_tokenize_as_transformers_converter_does(changes, tmp_path):
    """A Llama / Mistral SentencePiece vocabulary without merges: ours derives them from the scores
    as transformers does, and the tokenizer is transformers' LlamaTokenizer, byte fallback included."""
    tiny = write_tiny_gguf(tiny_hf("llama"), tmp_path / "tiny.gguf", "F32")
    (tmp_path / "vocab").mkdir()
    path = _with_sentencepiece(tiny, tmp_path / "vocab" / "model.gguf", changes)
    ours, theirs = _both(path, tmp_path)
    assert _tokenizer_json(ours) == _tokenizer_json(theirs)
    assert len(_tokenizer_json(ours)["model"]["merges"]) > 300
    _same_tokenizer(ours, path)
    _same_in_part(ours)


def test_merges_are_written_as_the_tokenizers_package_writes_them():
    """merge_entries (a BPE model's merges written without building it into the model): what
    Tokenizer.to_str writes for the same merges, a repeated pair where it last occurs, "a b" or
    [a, b] by whether a part holds a space; a merge outside the vocabulary refused."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    from layerplan.models.file_index import merge_entries, with_string_merges

    vocab = {w: i for i, w in enumerate(["a", "b", "c", "ab", "bc", "abc", "a b", " ", "a ", "a a "])}
    for merges in ([("a", "b"), ("b", "c"), ("ab", "c")],
                   [("a", "b"), ("b", "c"), ("a", "b"), ("ab", "c")],  # a repeat: the later place
                   [("a", "b"), ("a", " "), ("a ", "a ")]):  # parts with spaces: written as lists
        written = json.loads(Tokenizer(BPE(vocab=vocab, merges=merges)).to_str())["model"]["merges"]
        assert merge_entries(vocab, merges) == with_string_merges({"model": {"merges": written}})["model"]["merges"]
    for bad in ([("a", "c")], [("a", "x")], [("a", "b", "c")]):
        with pytest.raises(ValueError, match="merge"):
            merge_entries(vocab, bad)


def test_a_large_tokenizers_table_is_kept_with_its_index(tmp_path, monkeypatch):
    """The index writer keeps the table of a tokenizer.json of PARTIAL_TOKENIZER_BYTES or more (a
    later start reads it, not tokenizer.json), and none for a smaller one."""
    from tokenizers import Tokenizer

    from layerplan.models import file_index as index_writer
    from layerplan.models import tokenizer_table
    from layerplan.models.gguf_place import TOKENIZER_TABLE_FILE

    tiny = write_tiny_gguf(tiny_hf("llama"), tmp_path / "tiny.gguf", "F32")
    header = read_header(_with_sentencepiece(tiny, tmp_path / "model.gguf", {}))
    small = write_file_index(header, tmp_path / "small", INDEX_VERSION, TENSORS_FILE)
    assert not (small / TOKENIZER_TABLE_FILE).exists()
    monkeypatch.setattr(index_writer, "PARTIAL_TOKENIZER_BYTES", 0)
    large = write_file_index(header, tmp_path / "large", INDEX_VERSION, TENSORS_FILE)
    assert (large / TOKENIZER_TABLE_FILE).exists()

    def not_again(tokenizer_json):
        raise AssertionError("the kept table was made again")

    monkeypatch.setattr(tokenizer_table, "_build", not_again)
    whole = Tokenizer.from_file(str(large / "tokenizer.json"))
    assert tokenizer_table.PartialTokenizer.of_index(large).encode(CORPUS) == whole.encode(CORPUS).ids


def test_gemma_vocabularies_build_as_transformers_converter_builds_them(tmp_path, monkeypatch):
    """Gemma's rules (tokens of spaces respelled "▁▁", merges ranked by file order, no prefix space):
    the tokenizer transformers' converter makes from the same metadata, piece for piece. (The real
    Gemma 3 vocabulary, 262,144 tokens: test_the_real_gemma_vocabulary_tokenizes_as_transformers_does.)"""
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    from layerplan.models.file_index import sentencepiece_tokenizer

    tiny = write_tiny_gguf(tiny_hf("llama"), tmp_path / "tiny.gguf", "F32")
    path = _with_sentencepiece(tiny, tmp_path / "model.gguf", {"types": {300: 4}})
    header = read_header(path)
    tokens = list(header.metadata["tokenizer.ggml.tokens"])
    tokens[301], tokens[302] = "  ", "   "  # Gemma stores its tokens of spaces as spaces
    tokens[1], tokens[2], tokens[-2], tokens[-1] = "<bos>", "<eos>", "<pad>", "<mask>"  # GemmaTokenizer's names
    types = np.asarray(header.metadata["tokenizer.ggml.token_type"]).copy()
    types[-2:] = 3
    monkeypatch.setitem(header.metadata, "tokenizer.ggml.tokens", tokens)
    monkeypatch.setitem(header.metadata, "tokenizer.ggml.token_type", types)
    monkeypatch.setitem(header.metadata, "general.architecture", "gemma3")
    _, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
    tokenizer_dict["tokens"], tokenizer_dict["token_type"] = tokens, types.tolist()
    theirs, _ = convert_gguf_tokenizer("gemma3", tokenizer_dict)
    mine = json.loads(sentencepiece_tokenizer(header).to_str())
    reference = json.loads(theirs.to_str())
    for part in ("model", "normalizer", "pre_tokenizer", "decoder", "added_tokens"):
        assert mine[part] == reference[part], part
    assert mine["model"]["vocab"]["\u2581\u2581"] == 301
    for text in (CORPUS, "  two  spaces ", "x\n\n  y"):
        assert sentencepiece_tokenizer(header).encode(text).ids[1:] == theirs.encode(text).ids
    (tmp_path / "gemma").mkdir()
    sentencepiece_tokenizer(header).save(str(tmp_path / "gemma" / "tokenizer.json"))
    _same_in_part(tmp_path / "gemma")


def test_a_file_outside_the_tables_is_left_to_transformers(tmp_path, monkeypatch):
    """Phi-3's layers and a T5 (unigram) vocabulary are not in the file index's tables: the index is
    then made by transformers, as before."""
    from layerplan.models import file_index as tables

    path = write_tiny_gguf(tiny_hf("llama"), tmp_path / "tiny.gguf")
    header = read_header(path)
    monkeypatch.setitem(header.metadata, "tokenizer.ggml.model", "gpt2")
    assert "without merges" in file_index_refusal(header)
    monkeypatch.setitem(header.metadata, "tokenizer.ggml.model", "t5")
    assert file_index_refusal(header) == "a 't5' vocabulary is converted by transformers"
    monkeypatch.setitem(header.metadata, "general.architecture", "phi3")
    assert "architecture 'phi3'" in file_index_refusal(header)
    monkeypatch.setattr(tables, "MODEL_TENSORS", {**tables.MODEL_TENSORS, "llama": set()})
    monkeypatch.setitem(header.metadata, "general.architecture", "llama")
    monkeypatch.delitem(header.metadata, "tokenizer.ggml.model")
    assert "tensor 'token_embd.weight' is not in the file index's tables" in file_index_refusal(header)


def test_a_first_start_makes_the_index_without_torch_or_transformers(tmp_path):
    """The packaged model never seen (an empty cache): the light front end makes its index and
    packs its panels, and neither torch nor transformers is imported."""
    probe = ("import sys\n"
             "from layerplan.lite.cli import run, runnable\n"
             "from layerplan.app.cli.generating import light_request\n"
             "request = light_request(['generate', 'The capital of France is', '-n', '4'])\n"
             "assert runnable(request) and request.first_use\n"
             "assert run(request) == 0\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'accelerate')))\n")
    built = cache_dir() / "native"
    if built.exists():  # the kernels' library, built once per machine, not per file: not rebuilt here
        shutil.copytree(built, tmp_path / "cache" / "native", symlinks=True)
    env = {**os.environ, "LAYERPLAN_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert "its first use: indexed and packed for the kernels once" in done.stderr
    assert _facts(next((tmp_path / "cache" / "stored").iterdir()))["made_by"] == "file"


@pytest.mark.real
def test_the_real_qwen_vocabulary_tokenizes_as_transformers_does(tmp_path):
    """Qwen2.5-Coder-1.5B's 151,936-token vocabulary: in `make bench-real` (LAYERPLAN_REAL_MODELS
    names the folder real_models.sh fills), never in the default suite (a download, and 40 s)."""
    path = _real_file("qwen2.5-coder-1.5b-instruct-Q4_K_M.gguf")
    ours, theirs = _both(path, tmp_path)
    assert _facts(ours)["tensors"] == _facts(theirs)["tensors"]
    assert _facts(ours)["chat"] == _facts(theirs)["chat"]
    assert _tokenizer_json(ours) == _tokenizer_json(theirs)
    _same_tokenizer(ours, path)
    _same_in_part(ours)


@pytest.mark.real
def test_the_real_gemma_files_index_is_the_one_transformers_makes(tmp_path):
    """Gemma 3 270M (262,144-token SentencePiece vocabulary without merges: 514,906 derived from its
    order; sliding and full layers), in `make bench-real` only: the same tensors, config.json,
    tokenizer.json and chat frame as transformers' index, the rotary tables within a float32 step,
    and the same ids and text over the corpus."""
    path = _real_file("gemma-3-270m-Q4_K_M.gguf")
    ours, theirs = _both(path, tmp_path)
    assert _facts(ours)["tensors"] == _facts(theirs)["tensors"]
    assert _facts(ours)["chat"] == _facts(theirs)["chat"]
    _same_rotary_by_layer_type(ours, theirs)
    _same_config(ours, theirs)
    assert _tokenizer_json(ours) == _tokenizer_json(theirs)
    _same_tokenizer(ours, path)
    _same_in_part(ours)


def test_a_new_index_sweeps_those_of_files_gone_or_rewritten(tmp_path, monkeypatch):
    """Each index records its file (SOURCE_RECORD); the next index made removes those whose file is
    gone or changed (a suite's temporary files left thousands). An index made before the records
    is judged by the file its tensors file names and the key in its folder's name; a folder that
    has neither stays."""
    from layerplan.models.gguf_index import SOURCE_RECORD, file_index

    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path / "cache"))
    hf = tiny_hf("llama", 1)
    names = ("gone", "rewritten", "kept", "old-gone", "old-kept", "new")
    files = {name: tmp_path / f"{name}.gguf" for name in names}
    for path in files.values():
        write_tiny_gguf(hf, path)
    made = {name: file_index(path) for name, path in files.items() if name != "new"}
    assert json.loads((made["kept"] / SOURCE_RECORD).read_text())["path"] == str(files["kept"].resolve())
    for name in ("old-gone", "old-kept"):  # as an older layerplan made them
        (made[name] / SOURCE_RECORD).unlink()
    unknown = made["kept"].parent / "unknown-0123456789ab-v3"
    unknown.mkdir()
    for name in ("gone", "old-gone"):
        files[name].unlink()
    os.utime(files["rewritten"], ns=(0, files["rewritten"].stat().st_mtime_ns + 10**9))
    new = file_index(files["new"])
    assert sorted(p.name for p in new.parent.iterdir()) == sorted(
        [made["kept"].name, made["old-kept"].name, new.name, unknown.name])


def test_a_first_index_reports_its_slow_stages(tmp_path, monkeypatch):
    """on_progress(stage, done, total): a SentencePiece vocabulary's merges derived a token at a
    time (from 0 to the whole), then its tokenizer written; a byte-level vocabulary has no merges to
    derive. The index is the same with or without a listener."""
    from layerplan.models.file_index import DERIVING_MERGES, WRITING_TOKENIZER
    from layerplan.models.gguf_index import file_index

    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path / "cache"))
    tiny = write_tiny_gguf(tiny_hf("llama"), tmp_path / "tiny.gguf", "F32")
    (tmp_path / "vocab").mkdir()
    path = _with_sentencepiece(tiny, tmp_path / "vocab" / "model.gguf", {})
    heard = []
    index = file_index(path, lambda stage, done, total: heard.append((stage, done, total)))
    merges = [entry for entry in heard if entry[0] == DERIVING_MERGES]
    tokens = len(_sentencepiece_vocabulary()[0])
    assert merges[0] == (DERIVING_MERGES, 0, tokens) and merges[-1] == (DERIVING_MERGES, tokens, tokens)
    assert heard[len(merges):] == [(WRITING_TOKENIZER, 0, 1), (WRITING_TOKENIZER, 1, 1)]
    listened = _tokenizer_json(index)
    shutil.rmtree(index)
    assert _tokenizer_json(file_index(path)) == listened
    heard.clear()
    (tmp_path / "byte-level").mkdir()
    byte_level = _with_vocabulary(tiny, tmp_path / "byte-level" / "model.gguf", {})
    file_index(byte_level, lambda stage, done, total: heard.append((stage, done, total)))
    assert heard == [(WRITING_TOKENIZER, 0, 1), (WRITING_TOKENIZER, 1, 1)]

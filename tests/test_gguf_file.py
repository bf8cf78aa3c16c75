"""A GGUF read from the file itself (issue 47): the header reader (models/gguf_file.py) against
gguf-py's, the config built from it against transformers' reader, the tokenizer against
AutoTokenizer's, the dense load against transformers' own GGUF loader bit for bit, and the rule
that no command's default path on a GGUF writes a dense copy."""

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from layerplan.models.errors import ModelError
from layerplan.models.gguf_config import config_dict, load_config, load_tokenizer
from layerplan.models.gguf_file import read_header
from layerplan.models.gguf_place import default_gguf_path
from tiny import tiny_hf
from tiny_gguf import ARCHITECTURES, write_tiny_gguf

ARCHS = sorted(ARCHITECTURES)


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ggufs")
    return {arch: write_tiny_gguf(tiny_hf(arch), folder / f"{arch}.gguf", "Q4_0" if arch == "qwen2" else "Q8_0")
            for arch in ARCHS}


def _plain(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


def _same_header(path: Path) -> None:
    import gguf

    ours, theirs = read_header(path), gguf.GGUFReader(path)
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):  # the reader's own entries for the file's version and counts
            continue
        expected, found = field.contents(), _plain(ours.metadata[key])
        assert found == pytest.approx(expected) if isinstance(expected, float) else found == expected, key
    assert len(ours.metadata) == len([k for k in theirs.fields if not k.startswith("GGUF.")])
    assert [(t.name, t.shape, t.type_id, t.offset, t.nbytes) for t in ours.tensors] == [
        (t.name, tuple(int(n) for n in t.shape), int(t.tensor_type), int(t.data_offset), int(t.n_bytes))
        for t in theirs.tensors]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_header_reads_as_gguf_py_reads_it(tiny_ggufs, arch):
    _same_header(tiny_ggufs[arch])


def test_the_packaged_models_header_reads_as_gguf_py_reads_it():
    _same_header(default_gguf_path())  # a 49,152-token vocabulary, its merges and chat template


@pytest.mark.parametrize("arch", ARCHS)
def test_the_config_is_transformers_own(tiny_ggufs, arch):
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = tiny_ggufs[arch]
    header = read_header(path)
    assert config_dict(header) == load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    assert load_config(header).to_dict() == AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()


def test_the_packaged_models_config_and_tokenizer_are_transformers_own():
    from transformers import AutoConfig, AutoTokenizer

    path = default_gguf_path()
    header = read_header(path)
    config = load_config(header)
    assert config.to_dict() == AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    ours, theirs = load_tokenizer(header, config), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert type(ours) is type(theirs)
    text = (Path(__file__).parents[1] / "README.md").read_text() + "\n  two  spaces, wörds, 你好, 🙂 <|im_start|>x"
    ids = ours(text)["input_ids"]
    assert ids == theirs(text)["input_ids"] and ours.decode(ids) == theirs.decode(ids)
    assert (ours.bos_token, ours.eos_token, ours.chat_template) == (theirs.bos_token, theirs.eos_token,
                                                                      theirs.chat_template)


def test_a_file_without_the_magic_or_cut_short_is_one_line(tmp_path, tiny_ggufs):
    (tmp_path / "x.gguf").write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(ModelError, match="x.gguf: cannot read it as a GGUF model: it does not start with 'GGUF'"):
        read_header(tmp_path / "x.gguf")
    data = tiny_ggufs["llama"].read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:300])
    with pytest.raises(ModelError, match="cut.gguf: cannot read it as a GGUF model: its header ends early"):
        read_header(tmp_path / "cut.gguf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_dense_load_is_transformers_gguf_load_bit_for_bit(tiny_ggufs, arch, dtype, tmp_path, monkeypatch):
    """A GGUF at float32 / bfloat16 is dequantized from the file a matrix at a time, in memory (no
    dense copy written): the very parameters and logits transformers' own GGUF loader gives."""
    from transformers import AutoModelForCausalLM

    from layerplan.models import loading

    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path / "cache"))
    path = tiny_ggufs[arch]
    ours = loading.load_model(str(path), dtype=dtype).hf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    mine, reference = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert mine.keys() == reference.keys()
    for name, value in reference.items():
        assert mine[name].dtype == value.dtype and torch.equal(mine[name], value), name
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
    assert not (tmp_path / "cache" / "models").exists()  # nothing dense written


def test_model_depth_reads_the_header_and_converts_nothing(tiny_ggufs, tmp_path, monkeypatch):
    from layerplan.models.depth import model_depth

    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path / "cache"))
    assert model_depth(str(tiny_ggufs["qwen2"])) == (3, "qwen2")
    assert not (tmp_path / "cache").exists()


@pytest.mark.real
@pytest.mark.parametrize("args", [
    ["ppl", "--max-tokens", "48", "--window", "32", "--stride", "32"],
    ["scan", "--tokens", "24", "--kinds", "layer"],
    ["search", "--method", "greedy", "--tokens", "24", "--budget", "1"],
    ["generate", "Hello", "-n", "2"],
], ids=lambda args: args[0])
def test_no_command_dequantizes_a_gguf_by_default(args, tmp_path, monkeypatch):
    """The research commands, as generate, run a GGUF as stored unless a dense dtype is named:
    neither transformers' conversion (the old dense copy in the cache) nor a dense load runs."""
    from click.testing import CliRunner

    from layerplan.app import cli
    from layerplan.models import loading, stored

    def refused(*_args, **_kwargs):
        raise AssertionError("a default command dequantized the GGUF")

    monkeypatch.setattr(loading, "convert_gguf", refused)
    monkeypatch.setattr(loading, "load_dense", refused)
    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(cli.main, [*args, "--out", str(tmp_path / "out")] if args[0] in ("scan", "search")
                              else args)
    assert done.exit_code == 0, done.output
    assert "(stored-fast, cpu" in done.output or "(stored-fast," in done.output, done.output


@pytest.mark.parametrize("arch", ARCHS)
def test_the_tensor_names_map_as_transformers_maps_them(tiny_ggufs, arch):
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from layerplan.models.stored import meta_skeleton, gguf_to_parameter_names

    header = read_header(tiny_ggufs[arch])
    config = load_config(header)
    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=config.to_dict())
    skeleton = meta_skeleton(config)
    assert gguf_to_parameter_names(skeleton, processor, header.architecture) == get_gguf_hf_weights_map(skeleton,
                                                                                                       processor)

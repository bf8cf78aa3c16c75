"""The default arithmetic on a real GGUF is llama.cpp's: the same greedy tokens as llama.cpp's own
server on the same file. In `make bench-real` (LAYERPLAN_REAL_MODELS names the folder
real_models.sh fills; llama.cpp's tools built by `layerplan peers build`), never in the default
suite: the files are downloads and the server takes seconds to start."""

import os
from pathlib import Path

import pytest

from layerplan.app.llamacpp import find_tools
from layerplan.app.peers import llama_server, llama_server_call, llama_server_greedy
from layerplan.decoding.generate import generate
from layerplan.engine.load import load_model

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a goldsmith "
          "in Mainz, combined movable metal type with an oil-based ink and a wooden press adapted from")


def test_the_real_qwen_decodes_llama_servers_own_greedy_tokens():
    """Qwen2.5-Coder-1.5B Q4_K_M at default settings (stored-fast: Q8_K activations for its K-quants,
    Q8_0's for the rest, as llama.cpp quantizes them): 48 greedy tokens from the prompt's ids (as
    llama.cpp tokenizes them) equal llama-server's, EOS or not (BENCHMARKS.md record 474)."""
    path = Path(os.environ.get("LAYERPLAN_REAL_MODELS") or "/nonexistent") / "qwen2.5-coder-1.5b-instruct-Q4_K_M.gguf"
    if not path.is_file():
        pytest.skip(f"LAYERPLAN_REAL_MODELS does not name a folder with the real {path.name}")
    tools = find_tools(("llama-server",))
    if tools is None:
        pytest.skip("llama.cpp's tools are not built: layerplan peers build")
    with llama_server(tools, path, threads=2) as base:
        ids = llama_server_call(base, "/tokenize", {"content": PROMPT, "add_special": True})["tokens"]
        theirs = llama_server_greedy(base, ids, 48)
    model = load_model(str(path))
    assert model.precision == "stored-fast"
    ours = generate(model, ids, max_new_tokens=48, stop_at_eos=False).token_ids
    assert ours == theirs

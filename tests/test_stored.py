"""GGUF weights as stored (models/stored.py): the matrices stay in the file's blocks, and what they
stand for is exactly what transformers' own GGUF loader computes."""

from pathlib import Path

import numpy as np
import pytest
import torch

from layerplan.engine.kernel_library import ABI
from layerplan.models.architectures import ModelError
from layerplan.models.loading import load_stored_model
from layerplan.models.stored import StoredEmbedding, index_gguf, load_stored
from tiny import tiny_hf
from tiny_gguf import write_tiny_gguf


def _reference(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("matrix_type", ["Q8_0", "Q4_1", "Q4_0"])
def test_stored_matrices_are_transformers_dequantized_weights(tmp_path, arch, matrix_type):
    path = write_tiny_gguf(tiny_hf(arch, num_layers=2), tmp_path / f"{arch}.gguf", matrix_type)
    hf, stored = load_stored(path, index_gguf(path, tmp_path / "index"))
    reference = _reference(path).state_dict()
    assert set(stored.formats) == {matrix_type}
    for name, tensor in stored.tensors.items():  # q and k rows back in transformers' order
        assert torch.equal(tensor.dequantize(), reference[name]), name
    dense = {name: p for name, p in hf.named_parameters() if p.device.type != "meta"}
    assert dense and all(torch.equal(p, reference[name]) for name, p in dense.items())
    # the matrices are not in memory: every parameter left on the meta device has a stored tensor
    meta = [name for name, p in hf.named_parameters() if p.device.type == "meta"]
    assert meta and all(name in stored.tensors for name in meta)


def test_stored_embedding_looks_up_rows_and_names_a_bad_token(tmp_path):
    path = write_tiny_gguf(tiny_hf("llama", num_layers=1), tmp_path / "m.gguf", "Q8_0")
    hf, _ = load_stored(path, index_gguf(path, tmp_path / "index"))
    reference = _reference(path)
    ids = torch.tensor([[3, 0, 95, 3]])
    embedding = hf.get_input_embeddings()
    assert isinstance(embedding, StoredEmbedding)
    assert torch.equal(embedding(ids), reference.get_input_embeddings()(ids))
    with pytest.raises(ModelError, match="token id 96 is outside the vocabulary"):
        embedding(torch.tensor([[1, 96]]))


def test_index_is_written_once_and_names_a_damaged_file(tmp_path):
    path = write_tiny_gguf(tiny_hf("llama", num_layers=1), tmp_path / "m.gguf", "Q8_0")
    index = index_gguf(path, tmp_path / "index")
    assert (index / "config.json").exists() and not list(tmp_path.glob(".index.*"))
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ModelError, match="damaged.gguf: cannot read it as a GGUF model"):
        index_gguf(damaged, tmp_path / "index2")


def test_only_a_gguf_runs_as_stored(tmp_path):
    with pytest.raises(ModelError, match="is not a GGUF file"):
        load_stored_model(tmp_path)


@pytest.mark.real
def test_packaged_model_as_stored_reads_no_dense_matrices():
    model = load_stored_model("smollm2")
    assert model.stored.formats == {"Q4_1": 210, "Q8_0": 2}  # the tied head shares the Q8_0 table
    head = model.stored.of(model.parts.lm_head)
    assert head is not None and head is model.stored.tensors["model.embed_tokens.weight"]
    assert model.device == torch.device("cpu")
    assert all(p.device.type == "meta" for p in model.parts.layers[0].mlp.parameters())
    assert model.stored.tensors["model.layers.0.self_attn.q_proj.weight"].row_order is not None
    assert np.prod(model.parts.embed(torch.tensor([[1, 2]])).shape) == 2 * 576


def _stored_and_dense(tmp_path, arch: str, matrix_type: str, layers: int = 3, types: dict | None = None,
                      dtype: str = "stored"):
    """(the tiny GGUF run as stored on the native kernels, the same file dequantized by transformers
    and run on the native kernels in float32)."""
    from layerplan.engine.executors import use_native
    from layerplan.engine.choices import STORED
    from layerplan.engine.load import load_model, wrap_model

    path = write_tiny_gguf(tiny_hf(arch, num_layers=layers), tmp_path / f"{arch}.gguf", matrix_type, types)
    dense = wrap_model(_reference(path).eval())
    use_native(dense)
    assert dtype.startswith(STORED)
    return load_model(path, dtype=dtype, engine="native"), dense


@pytest.mark.parametrize("arch,matrix_type", [("llama", "Q8_0"), ("llama", "Q4_1"), ("qwen2", "Q4_0")])
def test_stored_run_equals_the_dequantized_run_bit_for_bit(tmp_path, arch, matrix_type):
    from layerplan.engine.runner import forward, new_cache

    stored, dense = _stored_and_dense(tmp_path, arch, matrix_type)
    assert stored.native is not None and not stored.native.eager_sub_layers()
    ids = torch.tensor([[5, 17, 3, 88, 41, 9, 60]])
    for text in (None, "0,1,1,2", "exit:2"):
        plan = stored.plan(text)
        got = forward(stored, ids, plan, cache=new_cache(plan, 64))
        want = forward(dense, ids, plan, cache=new_cache(plan, 64))
        assert torch.equal(got, want), text
    # incremental decoding over the cache, one token at a time, equals the whole pass
    cache = new_cache(stored.plan(), 64)
    steps = [forward(stored, ids[:, i:i + 1], cache=cache, start_pos=i) for i in range(ids.shape[1])]
    assert torch.allclose(torch.cat(steps, 1), forward(stored, ids, cache=new_cache(stored.plan(), 64)),
                          rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["stored", "stored-fast"])
def test_a_pass_whose_rows_are_shared_among_threads_gives_each_token_its_own_logits(tmp_path, dtype):
    """A pass shares its per-row work (norms, rotary, activations, residuals) among the threads
    only from LP_SPLIT_ELEMENTS (16384) elements on: with hidden 256, a 70-token pass shares it and
    a 5-token one keeps one thread. Either way each token gets the logits of decoding it alone."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from layerplan.engine.load import load_model
    from layerplan.engine.runner import forward, new_cache

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    path = write_tiny_gguf(AutoModelForCausalLM.from_config(config).eval(), tmp_path / "wide.gguf", "Q8_0")
    model = load_model(path, dtype=dtype, engine="native")
    ids = torch.randint(3, 96, (1, 77), generator=torch.Generator().manual_seed(3))
    plan = model.plan()
    cache = new_cache(plan, 80)
    forward(model, ids[:, :7], plan, cache, 0)
    alone = torch.cat([forward(model, ids[:, p:p + 1], plan, cache, p) for p in range(7, 77)], 1)
    for rows in (5, 70):
        cache.crop(7)
        assert torch.equal(forward(model, ids[:, 7:7 + rows], plan, cache, 7), alone[:, :rows]), rows


def test_stored_modules_run_one_layer_at_a_time_and_match_transformers(tmp_path):
    """The eager reference (StoredExecutor) dequantizes a layer for its step only."""
    from layerplan.engine.choices import STORED
    from layerplan.engine.load import load_model
    from layerplan.engine.runner import forward

    path = write_tiny_gguf(tiny_hf("llama", num_layers=3), tmp_path / "m.gguf", "Q8_0")
    model = load_model(path, dtype=STORED, engine="eager")
    ids = torch.tensor([[5, 17, 3, 88, 41]])
    logits = forward(model, ids)
    with torch.no_grad():
        reference = _reference(path)(ids).logits
    assert torch.allclose(logits, reference, rtol=1e-4, atol=1e-4)
    assert all(p.device.type == "meta" for layer in model.parts.layers for p in layer.mlp.parameters())


@pytest.mark.parametrize("dtype", ["stored", "stored-fast"])
@pytest.mark.parametrize("draft", ["ngram", "exit:2", "skip:attn=1", "suffix", "suffix:tree"])
def test_speculative_greedy_equals_plain_greedy_on_stored_weights(tmp_path, draft, dtype):
    from layerplan.decoding.generate import generate

    stored, _ = _stored_and_dense(tmp_path, "llama", "Q4_1", dtype=dtype)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    plain = generate(stored, prompt, max_new_tokens=16, stop_at_eos=False)
    fast = generate(stored, prompt, max_new_tokens=16, stop_at_eos=False, draft=draft)
    assert fast.token_ids == plain.token_ids


@pytest.mark.parametrize("dtype", ["stored", "stored-fast"])
def test_a_reduced_draft_head_scores_its_rows_of_the_stored_head(tmp_path, monkeypatch, dtype):
    """+vocab=K on a model run as stored: the K rows stay in the head's block format and run by
    the same kernels and arithmetic, so their scores are the full head's, bit for bit (a row's
    result never depends on the other rows); a draft through it is lossless and accepted."""
    from layerplan.decoding.drafters.heads import ReducedHead, reduced_head
    from layerplan.decoding.drafters.plan import PlanDrafter
    from layerplan.decoding.generate import generate
    from layerplan.engine.runner import head

    stored, _ = _stored_and_dense(tmp_path, "llama", "Q4_1", dtype=dtype)
    ids = torch.tensor([0, 2, 3, 17, 50, 95])
    hidden = torch.randn(1, 3, 32, generator=torch.Generator().manual_seed(0))
    full, formats = head(stored, hidden), dict(stored.stored.formats)
    reduced = ReducedHead(stored, ids)(hidden)
    assert torch.equal(reduced[..., ids], full[..., ids])
    outside = torch.ones(full.shape[-1], dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(reduced[..., outside]).all()
    assert stored.stored.formats == formats  # the derived rows are not the file's
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    plain = generate(stored, prompt, max_new_tokens=16, stop_at_eos=False)
    everything = ReducedHead(stored, torch.arange(full.shape[-1]))
    draft = PlanDrafter(stored.plan("exit:3"), head=everything)  # every layer: the target's own tokens
    result = generate(stored, prompt, max_new_tokens=16, stop_at_eos=False, draft=draft, draft_length="fixed")
    assert result.token_ids == plain.token_ids and result.stats["accepted"] == result.stats["drafted"] > 0
    # made once per model (a server builds each request's drafter anew)
    monkeypatch.setattr("layerplan.decoding.drafters.heads.frequent_tokens", lambda model, k, text: ids[:k])
    assert reduced_head(stored, 4, "text") is reduced_head(stored, 4, "text") is not reduced_head(stored, 5, "text")


def test_export_of_a_stored_model_equals_the_dequantized_export(tmp_path):
    from safetensors.torch import load_file

    from layerplan.export import export_checkpoint

    stored, dense = _stored_and_dense(tmp_path, "llama", "Q4_1")
    for model, folder in ((stored, tmp_path / "from-stored"), (dense, tmp_path / "from-dense")):
        export_checkpoint(model, model.plan("0,1,1,2/mlp"), folder)
    got, want = load_file(tmp_path / "from-stored" / "model.safetensors"), load_file(tmp_path / "from-dense" / "model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_v_projection_of_another_format_runs_apart_and_exactly(tmp_path):
    """Q4_K_M stores some layers' attn_v in Q6_K beside Q4_K q and k: v is packed as a matrix of
    its own in its format (no dense copy), and the logits stay those of the dequantized model."""
    from layerplan.engine.runner import forward, new_cache

    stored, dense = _stored_and_dense(tmp_path, "qwen2", "Q4_1", types={"attn_v": "Q8_0"})
    attention = stored.native.layers[0].attention
    assert attention.v.n == 2 * 8 and attention.qkv.n == 4 * 8 + 2 * 8  # kv_heads 2, heads 4, head_dim 8
    assert {attention.qkv.format, attention.v.format} == {ABI.LP_FORMAT_Q4_1, ABI.LP_FORMAT_Q8_0}
    ids = torch.tensor([[5, 17, 3, 88, 41, 9, 60]])
    plan = stored.plan()
    assert torch.equal(forward(stored, ids, plan, cache=new_cache(plan, 16)), forward(dense, ids, plan, cache=new_cache(plan, 16)))


def test_auto_runs_a_gguf_as_stored_where_the_kernels_run(tmp_path):
    from layerplan.engine.kernel_library import native_available
    from layerplan.engine.choices import BLOCK_PRECISIONS, GGUF_DEFAULT, STORED_FAST
    from layerplan.engine.load import choose_dtype

    path = write_tiny_gguf(tiny_hf("llama", num_layers=1), tmp_path / "m.gguf", "Q8_0")
    assert choose_dtype("auto", "eager", source=path) not in BLOCK_PRECISIONS  # the modules need dense weights
    assert choose_dtype("float32", source=path) == "float32"  # asked for: dequantized
    assert choose_dtype("auto", source=tmp_path / "no-such-folder") not in BLOCK_PRECISIONS
    assert choose_dtype("auto", source=tmp_path / "no-such-folder", dense="float32") == "float32"  # research
    assert GGUF_DEFAULT == STORED_FAST  # llama.cpp's arithmetic by default (docs/gguf-stored.md says why)
    if native_available() is None:
        assert choose_dtype("auto", source=path) == GGUF_DEFAULT
        assert choose_dtype("auto", source=path, dense="float32") == GGUF_DEFAULT  # a GGUF runs as stored
        assert choose_dtype("auto", source=None) == GGUF_DEFAULT  # load_model(): the packaged GGUF, as stored


@pytest.mark.parametrize("matrix_type", ["Q4_1", "Q4_0"])
def test_fast_arithmetic_takes_integer_products_close_to_the_exact_ones(tmp_path, matrix_type):
    """stored-fast: the matrices' products on int8 activations (LP_ARITH_INT8), not transformers'
    numbers but within the activations' rounding of them; a pass's rows do not depend on each other."""
    from layerplan.engine.runner import forward, new_cache

    fast, dense = _stored_and_dense(tmp_path, "llama", matrix_type, dtype="stored-fast")
    assert fast.precision == "stored-fast" and fast.stored.arithmetic == "fast"
    attention = fast.native.layers[0].attention
    assert attention.qkv.arithmetic == ABI.LP_ARITH_INT8 and attention.o.arithmetic == ABI.LP_ARITH_INT8
    ids = torch.tensor([[5, 17, 3, 88, 41, 9, 60]])
    got = forward(fast, ids, cache=new_cache(fast.plan(), 64))
    want = forward(dense, ids, cache=new_cache(dense.plan(), 64))
    assert not torch.equal(got, want)
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    cache = new_cache(fast.plan(), 64)
    steps = [forward(fast, ids[:, i:i + 1], cache=cache, start_pos=i) for i in range(ids.shape[1])]
    assert torch.allclose(torch.cat(steps, 1), got, rtol=1e-5, atol=1e-5)


def test_matrices_packed_in_parts_are_the_matrices_packed_whole(tmp_path, monkeypatch):
    """A large matrix is read and packed a part of whole panels at a time (the transient copy stays
    small): the packed bytes are those of the whole matrix packed at once."""
    from layerplan.engine.native import PackedMatrix

    stored, _ = _stored_and_dense(tmp_path, "llama", "Q4_1")
    weight = stored.stored.of(stored.parts.layers[0].mlp.gate_proj)
    whole = PackedMatrix([weight], [None])
    monkeypatch.setattr(PackedMatrix, "PACK_ROWS", 16)
    parts = PackedMatrix([weight], [None])
    assert weight.rows > 16 and torch.equal(parts.packed, whole.packed)
    with pytest.raises(ValueError, match="read whole"):
        stored.stored.of(stored.parts.layers[0].attention.q_proj).read_rows(first=16, count=16)


def test_a_stored_model_has_probe_rows_of_its_own(tmp_path):
    """The verify costs a stored model drafts by are its block kernels' (the probe row keyed by its
    precision), and the bytes a step streams are its stored blocks'."""
    from layerplan.engine.probe import model_engine_dtype, streamed_matrix_bytes, streamed_matrix_elements

    for dtype in ("stored", "stored-fast"):
        (tmp_path / dtype).mkdir()
        stored, dense = _stored_and_dense(tmp_path / dtype, "llama", "Q4_1", dtype=dtype)
        assert model_engine_dtype(stored) == ("native", dtype)
        nbytes, elements = streamed_matrix_bytes(stored, torch.float32)
        matrices = [t for name, t in stored.stored.tensors.items() if name != "model.embed_tokens.weight"]
        head = stored.stored.of(stored.parts.lm_head)
        if head is not None and head not in matrices:
            matrices.append(head)
        assert nbytes == sum(t.nbytes for t in matrices) and elements == sum(t.rows * t.columns for t in matrices)
        assert elements == streamed_matrix_elements(dense)


@pytest.mark.parametrize("text", ["0,1,1,2", "0,2,1/attn,1", "exit:2"])
def test_a_plan_exports_as_a_gguf_in_the_stored_types(tmp_path, text):
    """export --to gguf: the plan's layers copied byte for byte in their stored types (an off
    sub-layer's output projection zero); the file run as stored gives the plan's logits."""
    from gguf import GGUFReader

    from layerplan.engine.choices import STORED
    from layerplan.engine.load import load_model
    from layerplan.engine.runner import forward, new_cache
    from layerplan.export import export_gguf

    stored, _ = _stored_and_dense(tmp_path, "llama", "Q4_1", layers=3)
    plan = stored.plan(text)
    path = export_gguf(stored, plan, tmp_path / "merged.gguf")
    reader = GGUFReader(path)
    assert reader.fields["llama.block_count"].contents() == len(plan.active_steps)
    source = {t.name: t for t in GGUFReader(stored.source).tensors}
    for j, step in enumerate(plan.active_steps):
        q = next(t for t in reader.tensors if t.name == f"blk.{j}.attn_q.weight")
        assert q.tensor_type == source[f"blk.{step.layer}.attn_q.weight"].tensor_type
        assert np.array_equal(q.data, source[f"blk.{step.layer}.attn_q.weight"].data)
    merged = load_model(path, dtype=STORED, engine="native")
    ids = torch.tensor([[5, 17, 3, 88, 41, 9, 60]])
    want = forward(stored, ids, plan, cache=new_cache(plan, 16))
    got = forward(merged, ids, cache=new_cache(merged.plan(), 16))
    assert torch.equal(got, want)


def test_a_gemma3_plan_that_keeps_the_pattern_exports_as_a_gguf(tmp_path):
    """Gemma 3's layers are of two kinds, which a GGUF gives by position (llama.cpp: every sixth
    layer full): a plan whose layer j runs a layer of the kind position j has (a skip, a repeat of
    whole periods) exports and runs as the plan does; one that breaks the pattern is refused,
    naming the first layer out of it."""
    from layerplan.engine.choices import STORED
    from layerplan.engine.load import load_model
    from layerplan.engine.runner import forward, new_cache
    from layerplan.export import export_gguf

    stored = load_model(write_tiny_gguf(tiny_hf("gemma3_text", num_layers=12), tmp_path / "gemma3.gguf", "Q8_0"),
                        dtype=STORED, engine="native")
    kinds = stored.hf.config.layer_types
    assert kinds[5] == kinds[11] == "full_attention" and kinds.count("full_attention") == 2
    ids = torch.tensor([[5, 17, 3, 88, 41, 9, 60, 7, 30, 12]])
    for text in ("skip:attn=4;mlp=7", "0-11,6-11", "0-5,0-11"):
        plan = stored.plan(text)
        merged = load_model(export_gguf(stored, plan, tmp_path / "merged.gguf"), dtype=STORED, engine="native")
        assert merged.num_layers == len(plan.active_steps)
        want = forward(stored, ids, plan, cache=new_cache(plan, 16))
        assert torch.equal(forward(merged, ids, cache=new_cache(merged.plan(), 16)), want), text
    with pytest.raises(ValueError, match="the plan's layer 5 runs layer 6 .sliding_attention. where a GGUF of 11 "
                                         "layers has full_attention"):
        export_gguf(stored, stored.plan("0-4,6-11"), tmp_path / "broken.gguf")


def test_what_a_gguf_cannot_hold_is_refused_in_one_line(tmp_path):
    from layerplan.export import export_gguf

    stored, dense = _stored_and_dense(tmp_path, "llama", "Q4_1", layers=3)
    with pytest.raises(ValueError, match="scales its attention by 0.5"):
        export_gguf(stored, stored.plan("0,1@0.5,2"), tmp_path / "a.gguf")
    with pytest.raises(ValueError, match="use --to checkpoint"):
        export_gguf(dense, dense.plan("0,1"), tmp_path / "b.gguf")
    assert not list(tmp_path.glob("*.gguf*"))[1:]  # only the source file: nothing half-written


def test_export_takes_the_format_from_the_output_name(tmp_path):
    """`export P --out NAME.gguf` writes a GGUF in the stored types (no dense copy), NAME.yaml
    mergekit YAML; the commands explore suggests for a GGUF's plan name a .gguf, a plan a GGUF
    cannot hold a checkpoint folder."""
    from click.testing import CliRunner
    from gguf import GGUFReader

    from layerplan.app.cli import main
    from layerplan.app.merges import export_commands
    from layerplan.export_formats import export_format_of

    assert [export_format_of(n) for n in ("m.gguf", "m.GGUF", "m.yaml", "m.yml", "m", "m/")] == \
        ["gguf", "gguf", "mergekit", "mergekit", "checkpoint", "checkpoint"]
    stored, _ = _stored_and_dense(tmp_path, "llama", "Q4_1", layers=3)
    result = CliRunner().invoke(main, ["export", "0,1,1,2", "--model", stored.source, "--out",
                                       str(tmp_path / "merged.gguf")])
    assert result.exit_code == 0, result.output
    assert "stored types" in result.output and "dequantizing" not in result.output
    assert GGUFReader(tmp_path / "merged.gguf").fields["llama.block_count"].contents() == 4
    result = CliRunner().invoke(main, ["export", "0,1,1,2", "--model", stored.source, "--out",
                                       str(tmp_path / "merge.yaml")])
    assert result.exit_code == 0 and "passthrough" in (tmp_path / "merge.yaml").read_text()
    assert export_commands("0,1,1,2", stored, "m.gguf") == [
        "layerplan export 0,1,1,2 --model m.gguf --out merged.gguf", "layerplan export 0,1,1,2 --model m.gguf --out merged.yaml"]
    assert export_commands("0,1@0.5,2", stored, "m.gguf")[0].endswith("--out merged/")


@pytest.mark.parametrize("dtype", ["stored", "stored-fast"])
def test_exit_heads_train_on_a_gguf_as_stored(tmp_path, dtype):
    """train-exit on a GGUF runs it as stored: the training's final norm and LM head are the
    dense model's (the LM head alone dequantized, to the same floats), and the head learns."""
    from layerplan.decoding.drafters.heads import FrozenHead, train_exit_head
    from tiny import VOCAB

    stored, dense = _stored_and_dense(tmp_path, "llama", "Q4_1", layers=4, dtype=dtype)
    hidden = torch.randn(5, stored.hf.config.hidden_size, generator=torch.Generator().manual_seed(3))
    assert torch.equal(FrozenHead.of(stored)(hidden), FrozenHead.of(dense)(hidden))
    ids = torch.randint(3, VOCAB, (2, 64), generator=torch.Generator().manual_seed(4))
    head, report = train_exit_head(stored, ids, exit=2, steps=40, batch=64, lr=3e-3)
    assert report.kl_after < report.kl_before


@pytest.mark.parametrize("dtype", ["q8_0", "q5_0", "q4_1-fast"])
def test_a_checkpoint_quantized_at_load_runs_on_the_block_kernels(tmp_path, dtype):
    """--dtype q4_k etc.: a Hugging Face checkpoint's matrices quantized at load, run as a GGUF of
    that type would be: its logits are those of the dense model holding the dequantized values
    (exact arithmetic), or close to them (-fast), and drafts keep plain greedy output."""
    from layerplan.decoding.generate import generate
    from layerplan.engine.executors import use_native
    from layerplan.engine.load import load_model, wrap_model
    from layerplan.engine.runner import forward, new_cache

    hf = tiny_hf("llama", num_layers=2)
    hf.save_pretrained(tmp_path / "ckpt")
    quantized = load_model(tmp_path / "ckpt", dtype=dtype, engine="native")
    assert quantized.precision == dtype and quantized.native is not None
    assert all(p.device.type == "meta" for p in quantized.parts.layers[0].mlp.parameters())
    reference = tiny_hf("llama", num_layers=2)
    with torch.no_grad():
        for name, module in reference.named_modules():
            stored = quantized.stored.tensors.get(f"{name}.weight")
            if stored is not None:
                module.weight = torch.nn.Parameter(stored.dequantize())
    dense = wrap_model(reference)
    use_native(dense)
    ids = torch.tensor([[5, 17, 3, 88, 41, 9, 60]])
    got = forward(quantized, ids, cache=new_cache(quantized.plan(), 16))
    want = forward(dense, ids, cache=new_cache(dense.plan(), 16))
    if dtype.endswith("-fast"):
        assert (got - want).abs().max() <= 0.05 * want.abs().max()
    else:
        assert torch.equal(got, want)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    plain = generate(quantized, prompt, max_new_tokens=12, stop_at_eos=False)
    assert generate(quantized, prompt, max_new_tokens=12, stop_at_eos=False, draft="ngram").token_ids == plain.token_ids


@pytest.mark.parametrize("tied,dtype", [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16)])
def test_a_checkpoint_is_quantized_a_tensor_at_a_time(tmp_path, monkeypatch, tied, dtype):
    """--dtype q8_0 on a folder of safetensors reads and quantizes one tensor at a time (the model
    is never whole in float32): the same blocks, and the same logits, as quantizing the model
    loaded whole; a tied head is quantized from the embedding's table; bf16 weights are read as
    they are stored."""
    import numpy as np

    from layerplan.engine import load
    from layerplan.engine.runner import forward, new_cache
    from layerplan.models import loading

    hf = tiny_hf("llama", num_layers=2)
    if tied:
        hf.config.tie_word_embeddings = True
        hf.tie_weights()
    hf.to(dtype).save_pretrained(tmp_path / "ckpt")
    whole = load.prepare(load.quantize_linears(loading.load_model(tmp_path / "ckpt", "float32"), "q8_0"), "native",
                         pack=False)

    def refused(*_args, **_kwargs):
        raise AssertionError("the checkpoint was loaded whole")

    monkeypatch.setattr(loading, "load_model", refused)
    by_tensor = load.load_model(tmp_path / "ckpt", dtype="q8_0", engine="native")
    mine, reference = by_tensor.stored.tensors, whole.stored.tensors
    assert mine.keys() == reference.keys() and "lm_head.weight" in mine
    assert all(np.array_equal(mine[k].data, reference[k].data) for k in mine)
    assert all(p.device.type == "meta" for p in by_tensor.parts.layers[0].attention.parameters() if p.dim() == 2)
    ids = torch.tensor([[5, 17, 3, 88, 41, 9, 60]])
    assert torch.equal(forward(by_tensor, ids, cache=new_cache(by_tensor.plan(), 16)),
                       forward(whole, ids, cache=new_cache(whole.plan(), 16)))


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0-fast"])
def test_a_gguf_is_quantized_again_a_matrix_at_a_time(tmp_path, dtype):
    """--dtype FORMAT (and self:bits=FORMAT) on a GGUF: each matrix from the file's blocks to the
    format's, one at a time, the same rows as the whole model dequantized by transformers and
    quantized after (the path it replaces, which held the model dense in float32)."""
    from layerplan.engine.choices import QUANTIZED
    from layerplan.engine.load import load_model, prepare, quantize_linears
    from layerplan.engine.runner import forward, new_cache
    from layerplan.models.loading import load_model as load_dense_model

    path = write_tiny_gguf(tiny_hf("llama", num_layers=3), tmp_path / "llama.gguf", "Q4_1",
                           {"attn_v": "Q8_0", "ffn_down": "Q5_0"})
    model = load_model(path, dtype=dtype, engine="native")
    block_format, arithmetic = QUANTIZED[dtype]
    whole = prepare(quantize_linears(load_dense_model(path, "float32"), block_format, arithmetic), "native",
                    pack=False)
    assert model.precision == whole.precision == dtype and model.stored.formats == whole.stored.formats
    for name, tensor in whole.stored.tensors.items():
        assert np.array_equal(model.stored.tensors[name].data, tensor.data), name
    ids = torch.tensor([[5, 17, 3, 88, 41, 9, 60]])
    assert torch.equal(forward(model, ids, cache=new_cache(model.plan(), 64)),
                       forward(whole, ids, cache=new_cache(whole.plan(), 64)))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_damaged_checkpoint_quantized_at_load_is_one_line(tmp_path, damage):
    from layerplan.engine.load import load_model

    tiny_hf("llama", num_layers=1).save_pretrained(tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\xff" * 64 if damage == "garbage" else data[:len(data) - 100])
    with pytest.raises(ModelError, match=r"ckpt.*(cannot load its weights|ends inside a tensor)"):
        load_model(tmp_path / "ckpt", dtype="q8_0", engine="native")


def test_a_format_whose_blocks_fit_no_matrix_is_refused(tmp_path):
    from layerplan.engine.load import load_model

    tiny_hf("llama", num_layers=1).save_pretrained(tmp_path / "ckpt")  # 32 inputs wide: K-quants need 256
    with pytest.raises(ModelError, match="as q4_k blocks need"):
        load_model(tmp_path / "ckpt", dtype="q4_k", engine="native")


@pytest.mark.parametrize("described_by", ["file", "modules"])
def test_a_first_load_reports_its_packing(tmp_path, monkeypatch, described_by):
    """on_tensor(done, total) follows the bytes packed for the kernels at a GGUF's first use (the
    command line's progress bar), up to every matrix's, by either filler."""
    import torch as torch_

    from layerplan.engine import load, native
    from layerplan.engine.load import load_model

    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path / "cache"))
    if described_by == "modules":
        for module in (load, native):
            monkeypatch.setattr(module, "file_refusal", lambda index: "described by its modules here")
    monkeypatch.setattr(torch_, "get_num_threads", lambda: 2)  # (fill threads: the bar's jobs)
    path = write_tiny_gguf(tiny_hf("llama", num_layers=2), tmp_path / "m.gguf", "Q4_1")
    seen = []
    model = load_model(path, dtype="stored", engine="native", on_tensor=lambda done, total: seen.append((done, total)))
    assert model.native is not None and seen
    assert [done for done, _ in seen] == sorted(done for done, _ in seen) and seen[-1][0] == seen[-1][1]
    # bytes: the panels of each layer's qkv, o, gate_up and down, and of the LM head, at least their blocks'
    assert seen[-1][1] >= sum(t.nbytes for name, t in model.stored.tensors.items() if ".layers." in name)


@pytest.mark.parametrize("described_by", ["file", "modules"])
def test_kept_panels_load_bit_for_bit_and_are_packed_again_when_cut_short(tmp_path, monkeypatch, described_by):
    """A GGUF's packed panels are written once to the cache and read back by later loads (no
    packing), with the same logits; an entry cut short is packed again; a changed file, or the
    cache turned off, never reads them. Both fillers: the file's descriptors' (engine/file_kernels.py,
    a llama file's), and the modules' (PackedMatrix, where the file does not describe its model)."""
    import os

    from layerplan.engine import file_kernels, load, native
    from layerplan.engine.load import load_model
    from layerplan.engine.native import PackedMatrix
    from layerplan.engine.panel_cache import PanelCache
    from layerplan.engine.runner import forward

    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path / "cache"))
    if described_by == "modules":
        for module in (load, native):
            monkeypatch.setattr(module, "file_refusal", lambda index: "described by its modules here")
    path = write_tiny_gguf(tiny_hf("llama", num_layers=2), tmp_path / "m.gguf", "Q4_1")
    ids = torch.tensor([[5, 17, 3, 88, 41]])
    model = load_model(path, dtype="stored", engine="native")
    assert (model.native.file is not None) == (described_by == "file")
    want = forward(model, ids)
    folders = list((tmp_path / "cache" / "panels").iterdir())
    entries = sorted(folders[0].glob("*.panels"))
    assert len(folders) == 1 and len(entries) == 2 * 4 + 1  # qkv, o, gate_up, down a layer; the head

    packed, read = [], []
    if described_by == "file":
        pack = file_kernels.pack_stored
        monkeypatch.setattr(file_kernels, "pack_stored", lambda *args: packed.append(pack(*args)))
    else:
        pack_rows, read_parts = PackedMatrix._pack_rows, PanelCache.read_parts
        monkeypatch.setattr(PackedMatrix, "_pack_rows", lambda self, weights: packed.append(pack_rows(self, weights)))
        monkeypatch.setattr(PanelCache, "read_parts", lambda entry, *args, **kw: read.append(entry) or read_parts(
            entry, *args, **kw))
    for dtype in ("stored", "stored-fast"):  # the arithmetics share their panels
        model = load_model(path, dtype=dtype, engine="native")
        got = forward(model, ids)
        assert packed == [] and (torch.equal(got, want) if dtype == "stored" else torch.allclose(got, want, atol=0.3))
        if described_by == "file":  # every stack read from its entry, none packed
            assert model.native.file.packed.packed_here == 0 and len(model.native.file.packed._wanted) == 9
    if described_by == "modules":  # each matrix read from its entry, on the arena's fill threads
        assert len(read) == 2 * 9 and len(set(read)) == 9

    entries[0].write_bytes(entries[0].read_bytes()[:-1])
    assert torch.equal(forward(load_model(path, dtype="stored", engine="native"), ids), want)
    assert len(packed) == 1 and entries[0].stat().st_size > 0  # packed again, and kept whole again

    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert torch.equal(forward(load_model(path, dtype="stored", engine="native"), ids), want)
    # the changed file's new panels; its old ones swept, as no load can ask for them again
    assert len(list((tmp_path / "cache" / "panels").iterdir())) == 1 and len(packed) == 1 + 9
    monkeypatch.setenv("LAYERPLAN_PANEL_CACHE", "0")
    assert torch.equal(forward(load_model(path, dtype="stored", engine="native"), ids), want)
    assert len(packed) == 1 + 9 + 9


def test_kept_panels_beyond_the_budget_go_least_recently_loaded_first(tmp_path, monkeypatch):
    import os
    import time

    from layerplan.engine.panel_cache import PanelCache

    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path / "cache"))
    files = [tmp_path / f"{name}.gguf" for name in "abcd"]
    for age, file in enumerate(files):
        file.write_bytes(b"x")
        cache = PanelCache.for_file(file, "kernels")
        (cache.folder / "e.panels").write_bytes(bytes(1000))
        os.utime(cache.folder, (time.time() - 3600 * (10 - age),) * 2)  # a loaded first, d last
    monkeypatch.setenv("LAYERPLAN_PANEL_CACHE_BYTES", "2500")
    PanelCache.for_file(files[1], "kernels")  # b loaded again: now the most recent (and nothing evicted)
    assert len(list((tmp_path / "cache" / "panels").iterdir())) == 4
    (tmp_path / "e.gguf").write_bytes(b"x")
    PanelCache.for_file(tmp_path / "e.gguf", "kernels")  # a new file's first load: the budget applies
    kept = sorted(p.name[0] for p in (tmp_path / "cache" / "panels").iterdir())
    assert kept == ["b", "d", "e"]  # e (empty yet), b, then d: ~2200 bytes; c would make ~3300


def test_kept_panels_of_files_gone_go_first_and_small_files_count_against_a_large_one_never(tmp_path, monkeypatch):
    """Beyond KEPT_FOLDERS, only small files' panels go (a test suite's hundred tiny files leave a
    developer's 1B file's panels alone); a gone or rewritten file's panels go at the next load."""
    import os
    import time

    from layerplan.engine import panel_cache
    from layerplan.engine.panel_cache import PanelCache

    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(panel_cache, "KEPT_FOLDERS", 2)
    monkeypatch.setattr(panel_cache, "SMALL_FOLDER_BYTES", 500)
    files = {name: tmp_path / f"{name}.gguf" for name in ("large", "s1", "s2", "gone", "rewritten", "s3")}
    for age, (name, file) in enumerate(files.items()):
        file.write_bytes(b"x")
        cache = PanelCache.for_file(file, "kernels")
        (cache.folder / "e.panels").write_bytes(bytes(1000 if name == "large" else 10))
        os.utime(cache.folder, (time.time() - 3600 * (10 - age),) * 2)  # large loaded first, s3 last
    files["gone"].unlink()
    files["rewritten"].write_bytes(b"xy")
    os.utime(PanelCache.for_file(files["s1"], "kernels").folder, (time.time() - 120,) * 2)  # s1 loaded again
    files["s4"] = tmp_path / "s4.gguf"
    files["s4"].write_bytes(b"x")
    PanelCache.for_file(files["s4"], "kernels")  # a new file's first load: the sweep and the limits
    kept = sorted(p.name.split("-")[0] for p in (tmp_path / "cache" / "panels").iterdir())
    # s4 and s1: two small ones; s3 and s2 beyond them; the gone and the rewritten file's swept; the
    # large one, oldest, stays
    assert kept == ["large", "s1", "s4"]


def test_a_files_panels_of_older_kernels_go_beyond_the_kept_builds_of_an_isa(tmp_path, monkeypatch):
    """Each kernels build packs a file's panels into a folder of its own: at a new build's first
    load, the same file's folders of older builds of the same ISA go (KEPT_BUILDS: the most
    recently used alone; $LAYERPLAN_PANEL_BUILDS=2 the two most recently used), and one made before
    builds were recorded counts as such; another ISA's, other files', and any used in the last
    minute stay."""
    import os
    import time

    from layerplan.engine import panel_cache
    from layerplan.engine.kernel_library import Isa
    from layerplan.engine.panel_cache import BUILD_RECORD, PanelCache

    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LAYERPLAN_PANEL_BUILDS", "2")
    model, other = tmp_path / "model.gguf", tmp_path / "other.gguf"
    model.write_bytes(b"x")
    other.write_bytes(b"y")
    isa = {"name": "avx2"}
    monkeypatch.setattr(panel_cache, "choose_isa", lambda: Isa(isa["name"], frozenset(), (), ()))

    def load(file, kernels, hours_ago):
        folder = PanelCache.for_file(file, kernels).folder
        os.utime(folder, (time.time() - 3600 * hours_ago,) * 2)
        return folder

    def kept():
        return sorted(p.name for p in (tmp_path / "cache" / "panels").iterdir())

    old = load(model, "v1", 9)
    (old / BUILD_RECORD).unlink()  # made before builds were recorded
    os.utime(old, (time.time() - 3600 * 9,) * 2)
    v2, others = load(model, "v2", 8), load(other, "v1", 7)
    isa["name"] = "avx512vnni"
    wide = load(model, "v2-avx512vnni", 6)  # (a kernels key names its ISA)
    isa["name"] = "avx2"
    v3 = load(model, "v3", 5)  # two kept: v3 and v2 of avx2; old (no record) goes
    assert kept() == sorted(p.name for p in (v2, others, wide, v3))
    v4 = load(model, "v4", 4)  # v2 goes, v3 stays: two avx2 builds
    assert kept() == sorted(p.name for p in (others, wide, v3, v4))
    monkeypatch.delenv("LAYERPLAN_PANEL_BUILDS")
    v5 = load(model, "v5", 0)  # the default: v5 alone of avx2
    assert kept() == sorted(p.name for p in (others, wide, v5))
    v6 = PanelCache.for_file(model, "v6").folder  # v5, used in the last minute, stays
    assert kept() == sorted(p.name for p in (others, wide, v5, v6))


def test_kept_panels_are_read_in_parts_and_a_short_part_is_named(tmp_path, monkeypatch):
    """read_parts: every part a job of its own, into its place; one that comes up short (the
    entry cut while read) calls `short` and reports False."""
    from layerplan.engine.panel_cache import PanelCache

    monkeypatch.setattr(PanelCache, "READ_BYTES", 4)
    entry = tmp_path / "e.panels"
    entry.write_bytes(bytes(range(10)))
    jobs, shorts = [], []

    def run_now(job, nbytes):
        jobs.append((job, nbytes))
        from concurrent.futures import Future
        done = Future()
        done.set_result(job())
        return done

    out = torch.zeros(10, dtype=torch.uint8)
    assert [f.result() for f in PanelCache.read_parts(entry, out, run_now, lambda: shorts.append(1))] == [True] * 3
    assert [n for _, n in jobs] == [4, 4, 2] and out.tolist() == list(range(10)) and not shorts
    longer = torch.zeros(12, dtype=torch.uint8)
    assert [f.result() for f in PanelCache.read_parts(entry, longer, run_now, lambda: shorts.append(1))] == \
        [True, True, False]
    assert shorts == [1]


_MODELLING_PROBE = """
import sys
from click.testing import CliRunner
from layerplan.app.cli import main
for argv in ARGVS:
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, (argv, result.output)
# an architecture's modelling code (modeling_llama, ...) and transformers' model base class
loaded = sorted(name for name in sys.modules if name.startswith("transformers.") and (
    name == "transformers.modeling_utils" or (name.startswith("transformers.models.") and ".modeling_" in name
                                              and not name.endswith(".modeling_auto"))))
print(loaded)
"""


@pytest.mark.real
def test_no_command_imports_transformers_modelling_code_for_a_gguf(tmp_path):
    """The same commands on the packaged GGUF (a fresh process each time, a cache never used) run
    the file's model (engine/file_model.py): transformers' modelling code is never imported, nor
    its model base class, where the kernels describe the architecture."""
    import os
    import shutil
    import subprocess
    import sys

    from layerplan.files import cache_dir

    built, cache = cache_dir() / "native", tmp_path / "cache"
    if built.exists():
        shutil.copytree(built, cache / "native", symlinks=True)
    argvs = [["generate", "Hi", "-n", "2", "--draft", "ngram"],
             ["ppl", "--max-tokens", "24", "--window", "16", "--stride", "8"],
             ["scan", "--tokens", "12", "--kinds", "attention", "--out", str(tmp_path / "scan")],
             # (bench times transformers only when told: it would run the file dequantized)
             ["bench", "-n", "2", "--repeats", "1", "--prompt", "code", "--no-llama-cpp",
              "--out", str(tmp_path / "bench.json")]]
    for argv in argvs:  # the first makes the index and panels; each its own process
        out = subprocess.run([sys.executable, "-c", _MODELLING_PROBE.replace("ARGVS", repr([argv]))],
                             env={**os.environ, "LAYERPLAN_CACHE": str(cache)}, capture_output=True, text=True)
        assert out.returncode == 0, (argv, out.stderr[-2000:])
        assert out.stdout.strip().splitlines()[-1] == "[]", (argv, out.stdout[-2000:])


@pytest.mark.real
def test_no_command_writes_a_dense_copy_of_a_gguf(tmp_path, monkeypatch):
    """The commands' default paths on a GGUF (the packaged one, a cache never used) run it as
    stored: the index and the packed panels are written, never a dense conversion (cache/models,
    any .safetensors but the exit head asked for), nor is the model dequantized whole in memory."""
    import shutil

    from click.testing import CliRunner

    from layerplan.app.cli import main
    from layerplan.files import cache_dir

    built = cache_dir() / "native"
    cache = tmp_path / "cache"
    if built.exists():  # (the kernels' library, built once per machine)
        shutil.copytree(built, cache / "native", symlinks=True)
    monkeypatch.setenv("LAYERPLAN_CACHE", str(cache))
    commands = [["generate", "Hi", "-n", "2", "--draft", "ngram"],
                ["ppl", "--max-tokens", "24", "--window", "16", "--stride", "8"],
                ["scan", "--tokens", "12", "--kinds", "attention", "--out", str(tmp_path / "scan")],
                ["bench", "-n", "2", "--repeats", "1", "--prompt", "code", "--no-llama-cpp",
                 "--out", str(tmp_path / "bench.json")],
                ["train-exit", "--exit", "2", "--steps", "2", "--tokens", "64", "--out", str(tmp_path / "h.safetensors")]]
    for argv in commands:
        result = CliRunner().invoke(main, argv)
        assert result.exit_code == 0, (argv, result.output)
        assert "dequantizing" not in result.output, argv  # nor a whole dense copy in memory
    assert not (cache / "models").exists() and not list(cache.rglob("*.safetensors"))  # (h.safetensors: not in the cache)
    assert list((cache / "stored").glob("*/tensors.json")) and list((cache / "panels").glob("*/*.panels"))

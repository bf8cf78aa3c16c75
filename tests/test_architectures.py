"""Every architecture layerplan lists as checked, on a tiny random config of it (the same one
engine/verify.py builds): identity plan == transformers, exit after k == truncated checkpoint,
repeat == physically duplicated checkpoint, speculative greedy == plain greedy; and the list
itself (status of every causal LM of the installed transformers, refusals, discovery vs table)."""

from functools import cache

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from layerplan.decoding.generate import generate
from layerplan.engine.runner import forward
from layerplan.export import export_checkpoint, plan_config, plan_state_dict
from layerplan.models.arch_table import ARCHITECTURES, REFERENCE_ARCHITECTURES
from layerplan.models.architectures import (MIXTURE_OF_EXPERTS, NAMED_FAMILIES, NOT_SUPPORTED, REFUSED, TINY_CHECKED,
                                            ModelError, architecture_statuses, refusal_of_config)
from layerplan.models.discovery import discover_spec, tiny_config, tiny_model
from layerplan.models.loading import LoadedModel
from layerplan.engine.verify import TOLERANCE, check_ids, check_model, incremental_logits
from layerplan.plan.plan import parse_plan

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8]


@cache
def tiny_hf(arch: str):
    return tiny_model(tiny_config(AutoConfig.for_model(arch)))


@cache
def tiny(arch: str) -> LoadedModel:
    """One shared model per architecture (its check is test_identity_plan_equals_transformers)."""
    return LoadedModel(name=f"tiny-{arch}", hf=tiny_hf(arch), tokenizer=None, source="tiny", require_check=False)


def reload(folder, model):
    attn = model.hf.config._attn_implementation
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn).eval()


def rebuild(model, plan):
    """The checkpoint export writes, built in memory (the disk round trip is tested below)."""
    config = plan_config(model, plan)
    torch.manual_seed(0)
    built = AutoModelForCausalLM.from_config(config, attn_implementation=model.hf.config._attn_implementation)
    built.load_state_dict(plan_state_dict(model, plan), strict=True)
    return built.eval()


def assert_close(logits, reference):
    assert (logits - reference).abs().max() < TOLERANCE


@pytest.mark.parametrize("arch", TINY_CHECKED)
def test_identity_plan_equals_transformers(arch):
    result = check_model(tiny_hf(arch))  # prefill and incremental, float32, fresh (no cache)
    assert result.passed, result.detail


@pytest.mark.parametrize("arch", TINY_CHECKED)
def test_exit_after_k_equals_truncated_checkpoint(arch):
    model = tiny(arch)
    ids = check_ids(3)
    truncated = rebuild(model, parse_plan("0-1", model.num_layers))
    with torch.no_grad():
        reference = truncated(ids).logits
    plan = parse_plan("exit:2", model.num_layers)
    assert_close(forward(model, ids, plan), reference)
    assert_close(incremental_logits(model, ids, plan), reference)


@pytest.mark.parametrize("arch", TINY_CHECKED)
def test_repeat_equals_duplicated_checkpoint(arch, tmp_path):
    """A repeated layer (own KV slot) with a residual scale == the checkpoint export builds, where
    the scale is folded into the weights (output projections, experts, or post-norms)."""
    model = tiny(arch)
    plan = parse_plan("0,1,1@0.5,2", model.num_layers)
    duplicated = reload(export_checkpoint(model, plan, tmp_path / "d"), model)
    assert duplicated.config.num_hidden_layers == 4
    ids = check_ids(4)
    with torch.no_grad():
        reference = duplicated(ids).logits
    assert_close(forward(model, ids, plan), reference)
    assert_close(incremental_logits(model, ids, plan), reference)


@pytest.mark.parametrize("arch", TINY_CHECKED)
def test_speculative_greedy_equals_plain_greedy(arch):
    model = tiny(arch)
    plain = generate(model, PROMPT, max_new_tokens=10, stop_at_eos=False).token_ids
    result = generate(model, PROMPT, max_new_tokens=10, stop_at_eos=False, draft="skip:attn=1;mlp=1", draft_length="fixed")
    assert result.token_ids == plain


# ----- the list ----------------------------------------------------------------------------------
def test_every_causal_lm_of_transformers_has_a_status():
    statuses = {s.model_type: s for s in architecture_statuses()}
    assert set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) <= set(statuses)
    assert not set(TINY_CHECKED) & (set(REFUSED) | set(NOT_SUPPORTED))
    assert len(TINY_CHECKED) >= 40 and len(set(TINY_CHECKED) & MIXTURE_OF_EXPERTS) >= 8
    for family, model_type in NAMED_FAMILIES.items():  # the families the installed transformers has
        assert model_type in TINY_CHECKED, family
    assert statuses["llama"].status == "verified on a real checkpoint"
    assert statuses["mamba"].status == "refused"


def test_config_level_refusals_say_why():
    checked = 0
    for arch, reason in REFUSED.items():
        refusal = refusal_of_config(AutoConfig.for_model(arch))
        if refusal is not None:  # the others are refused by discovery (a parallel block, an encoder's layers)
            assert refusal == reason, arch
            checked += 1
    assert checked >= 40


def test_a_verified_type_refuses_a_config_it_cannot_run():
    """Falcon with rotary positions is verified, one positioned by ALiBi refused; OPT-350m's layout too."""
    assert refusal_of_config(AutoConfig.for_model("falcon")) is None
    assert "ALiBi" in refusal_of_config(AutoConfig.for_model("falcon", alibi=True))
    assert refusal_of_config(AutoConfig.for_model("opt")) is None  # OPT-125m's layout: pre-norm
    assert "do_layer_norm_before" in refusal_of_config(AutoConfig.for_model("opt", do_layer_norm_before=False))
    assert "word_embed_proj_dim" in refusal_of_config(AutoConfig.for_model("opt", word_embed_proj_dim=512))
    assert "add_cross_attention" in refusal_of_config(AutoConfig.for_model("xglm", add_cross_attention=True))


@pytest.mark.parametrize("arch", REFERENCE_ARCHITECTURES)
def test_discovery_finds_what_the_table_says(arch):
    found, written = discover_spec(tiny_hf("gemma3_text" if arch == "gemma3_text" else arch)), ARCHITECTURES[arch]
    for field in ("backbone", "embed", "layers", "final_norm", "attention", "attention_norm", "mlp", "mlp_norm",
                  "attention_post_norm", "mlp_post_norm", "position_embed", "rope_per_layer_type", "norm_weight_offset"):
        assert getattr(found, field) == getattr(written, field), field


def test_failed_check_names_what_differed():
    result = check_model(tiny_hf("doge"))  # Doge's layers do more than a residual add: not runnable yet
    assert not result.passed
    assert "architecture 'doge' failed its check against transformers: prefill logits differ" in result.detail
    assert "\n" not in result.detail


def test_check_is_cached_and_gates_loading(tmp_path, monkeypatch):
    from layerplan.engine import verify
    from layerplan.engine.load import wrap_model

    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path / "cache"))
    hf = tiny_hf("olmo2")
    with pytest.raises(ModelError, match="discovered but not yet checked against transformers"):
        LoadedModel(name="x", hf=hf, tokenizer=None, source="x")
    assert verify.check_architecture(hf.config).passed
    assert list((tmp_path / "cache" / "architectures").glob("olmo2-*.check.json"))
    LoadedModel(name="x", hf=hf, tokenizer=None, source="x")  # now allowed
    monkeypatch.setattr(verify, "run_check", lambda config: pytest.fail("the cached answer was not used"))
    assert verify.check_architecture(hf.config).passed
    assert wrap_model(hf).num_layers == 3


def test_refused_architecture_is_one_line(tmp_path):
    from transformers import MambaConfig

    from layerplan.engine.verify import check_architecture

    result = check_architecture(MambaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2))
    assert not result.passed and "recurrent" in result.detail and "\n" not in result.detail


def test_the_docs_list_every_architecture():
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "architectures.md").read_text()
    section = doc[doc.index("## Every causal LM of transformers, by status"):]
    missing = [s.model_type for s in architecture_statuses() if f"`{s.model_type}`" not in section]
    assert not missing, (f"docs/architectures.md's status section misses {missing}: regenerate it from "
                         "`layerplan models --architectures`")


def test_load_a_discovered_architecture_from_a_folder(tmp_path, monkeypatch):
    """The whole path a user takes: a checkpoint folder of an architecture outside the table
    (Gemma 2: eager attention only) is checked once, then loaded and run."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from layerplan.engine.load import load_model

    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path / "cache"))
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(tmp_path / "m")
    tiny_hf("gemma2").save_pretrained(tmp_path / "m")
    model = load_model(tmp_path / "m", dtype="float32")
    assert model.hf.config._attn_implementation == "eager"
    assert list((tmp_path / "cache" / "architectures").glob("gemma2-*.check.json"))
    ids = check_ids(5)
    with torch.no_grad():
        assert_close(forward(model, ids), model.hf(ids).logits)


def test_cli_lists_and_checks_architectures(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from layerplan.app.cli import main

    monkeypatch.setenv("LAYERPLAN_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(main, ["models", "--architectures"])
    assert result.exit_code == 0
    assert "olmoe" in result.output and "verified on a tiny config" in result.output and "MoE" in result.output
    assert "architectures: 1 verified on a real checkpoint" in result.output
    result = CliRunner().invoke(main, ["models", "--check", "mamba"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "mamba: failed: architecture 'mamba' is refused: " + REFUSED["mamba"]]
    result = CliRunner().invoke(main, ["models", "--check", "no-such-thing"])
    assert result.exit_code != 0 and "neither a model_type of transformers" in result.output


def test_the_architecture_status_is_package_data():
    import tomllib
    from pathlib import Path

    from layerplan.models import architectures

    root = Path(architectures.__file__).resolve().parents[3]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["layerplan"]
    assert f"models/{architectures.STATUS_FILE}" in data
    assert Path(architectures.__file__).with_name(architectures.STATUS_FILE).is_file()
    assert architectures.CHECKED_WITH.startswith("transformers ") and architectures.TINY_CHECKED


def test_the_status_generator_files_refusals_failures_and_passes():
    from layerplan.app.architecture_status import update

    status = {"checked_with": "-", "real_checkpoint": {}, "tiny_checked": [], "mixture_of_experts": [], "refused": {},
              "not_supported": {"doge": "a reason written by hand"}}
    passed = update(status, ["mamba", "doge", "olmo2"], "9.9")
    assert status["refused"] == {"mamba": REFUSED["mamba"]}
    assert status["not_supported"]["doge"].startswith("failed its check against transformers: prefill logits differ")
    assert passed == ["olmo2"] and status["checked_with"] == "transformers 9.9"


def test_the_fast_lanes_architectures_are_in_the_table():
    from conftest import FAST_ARCHITECTURES

    assert FAST_ARCHITECTURES <= set(TINY_CHECKED)

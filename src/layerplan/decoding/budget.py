"""How many new tokens a generation may ask for: the prompt and its continuation fit the model's
context. One check, for the command line (generate) and the server alike, made before any work."""

from __future__ import annotations


# a count of new tokens that asks for as many as the context leaves (llama.cpp's -n -1 and -2)
UNTIL_CONTEXT = -1


class ContextLengthError(ValueError):
    """A prompt, or a prompt and its new tokens, longer than the model's context. `param` names
    what is too long: 'prompt' or 'max_tokens'."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def token_budget(prompt_tokens: int, asked: int | None, context_length: int, default: int | None = None,
                 new_tokens_name: str = "max_tokens") -> int:
    """The number of new tokens to generate: `asked`, or when None `default` (None: all the room
    left), or when UNTIL_CONTEXT all the room left; never more than the context leaves after the
    prompt. ContextLengthError when the prompt fills the context or `asked` does not fit;
    new_tokens_name names `asked` in the message."""
    if prompt_tokens >= context_length:
        raise ContextLengthError(f"the prompt is {_tokens(prompt_tokens)}; the model's context is "
                                 f"{_tokens(context_length)}", "prompt")
    room = context_length - prompt_tokens
    if asked == UNTIL_CONTEXT:
        return room
    if asked is None:
        return room if default is None else min(default, room)
    if asked > room:
        raise ContextLengthError(f"{new_tokens_name}={asked} does not fit: the prompt is {_tokens(prompt_tokens)} and "
                                 f"the model's context is {_tokens(context_length)} (at most {room} new "
                                 f"token{'s' if room != 1 else ''})", "max_tokens")
    return asked


def _tokens(count: int) -> str:
    return f"{count} token{'s' if count != 1 else ''}"

"""The light front end: a GGUF's plain generation, chat, perplexity, scans and searches on the native
kernels, without torch or transformers (model.py: the model from the file's index, run by
decoding/loop.py's loop; chat.py: a conversation with it; cli.py: the invocations it serves). What
it cannot run, the torch front end runs."""

# LAYERPLAN_FRONT_END=torch: every command line to the torch front end (app/launch.py)
FRONT_END_VARIABLE = "LAYERPLAN_FRONT_END"


class TorchFrontEnd(Exception):
    """What the light front end found it cannot run (the message says what); the torch front end runs it."""

"""The light front end: a GGUF's plain generation and its perplexity on the native kernels,
without torch or transformers (model.py: the model from the file's index, run by decoding/loop.py's
loop; cli.py: the `layerplan generate` and `layerplan ppl` invocations it serves). What it cannot
run, the torch front end runs."""

# LAYERPLAN_FRONT_END=torch: every command line to the torch front end (app/launch.py)
FRONT_END_VARIABLE = "LAYERPLAN_FRONT_END"

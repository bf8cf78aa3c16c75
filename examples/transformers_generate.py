"""layerplan's decoding from inside transformers' own `model.generate`.

Run: python examples/transformers_generate.py   (uses the packaged SmolLM2; no download)
"""

import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerplan.app.integrations.hf_generate import layerplan_generate
from layerplan.models.loading import convert_gguf, default_gguf_path

folder = convert_gguf(default_gguf_path())  # any HF checkpoint folder works the same way
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(folder)
prompt = "def is_prime(n):\n    if n < 2:\n        return False\n    for i in range(2, int(n ** 0.5) + 1):\n"
inputs = tokenizer(prompt, return_tensors="pt")

start = time.perf_counter()
plain = model.generate(**inputs, max_new_tokens=48, do_sample=False)
middle = time.perf_counter()
# the same call, with layerplan's loop and a lossless n-gram draft
fast = model.generate(**inputs, max_new_tokens=48, do_sample=False, custom_generate=layerplan_generate, draft="ngram")
end = time.perf_counter()

print(tokenizer.decode(fast[0, inputs.input_ids.shape[1]:]))
print(f"transformers {middle - start:.2f} s, layerplan + ngram draft {end - middle:.2f} s")
print(f"identical to transformers' greedy output: {torch.equal(plain, fast)}")
# a plan works too (lossy unless it is the full model): custom_generate=layerplan_generate, plan="skip:mlp=20"

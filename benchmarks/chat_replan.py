"""`/plan` mid-conversation on the light front end (lite/chat.py): a four-turn conversation run
again through each plan from the kept stream before its first changed step, against a fresh
prefill of the same tokens through that plan; 3 rounds, median (range).

    python benchmarks/chat_replan.py MODEL PLAN [PLAN ...]
"""

import statistics, sys, time
from layerplan.decoding.chat_state import ChatSettings
from layerplan.lite.chat import LightChatSession
from layerplan.lite.model import LiteModel
from layerplan.lite.request import ARITHMETICS
from layerplan.models.gguf_place import gguf_of

model = LiteModel(gguf_of(sys.argv[1]), ARITHMETICS["auto"])
plans = sys.argv[2:]
rows = {p: ([], []) for p in plans}
for round_ in range(3):
    session = LightChatSession(model, ChatSettings(max_new_tokens=48))
    for text in ("Explain how a hash map works.", "Now compare it with a binary search tree.",
                 "Which would you use for a phone book, and why?", "Write a short Python example of each."):
        session.reply(text)
    held = list(session.cached)
    for plan in plans:
        session.set_plan("full")
        t = time.perf_counter(); note = session.set_plan(plan); replan = time.perf_counter() - t
        cache = model.new_cache(session.plan, len(held) + 8)
        t = time.perf_counter(); model.logits(held, cache, 0); fresh = time.perf_counter() - t
        rows[plan][0].append(replan); rows[plan][1].append(fresh)
        if round_ == 0:
            print(plan, note, file=sys.stderr)
print(f"conversation {len(held)} tokens")
for plan, (replan, fresh) in rows.items():
    print(f"{plan}: /plan {statistics.median(replan)*1000:.0f} ms ({min(replan)*1000:.0f}-{max(replan)*1000:.0f}), "
          f"fresh prefill {statistics.median(fresh)*1000:.0f} ms ({min(fresh)*1000:.0f}-{max(fresh)*1000:.0f})")

"""`layerplan chat` on the light front end (lite/chat.py), against the torch front end's session
(app/chat.py) on the packaged SmolLM2: the same replies turn by turn, the same cache kept between
turns, across a plan switch, a system message and a reset; the command from a pipe gives the torch
front end's output, a drafted one's too, and a line only the torch front end runs (a draft that
runs torch modules) hands the conversation on to it, the lines after it answered there, nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from layerplan.app.cli.chatting import UnbufferedLines, light_chat_request
from layerplan.decoding.chat_state import ChatSettings
from layerplan.lite import TorchFrontEnd

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def both():
    """SmolLM2 on the light front end and on the torch one, in the same arithmetic."""
    from layerplan.engine.load import load_model
    from layerplan.lite.model import LiteModel
    from layerplan.lite.request import ARITHMETICS
    from layerplan.models.gguf_place import gguf_of

    return LiteModel(gguf_of("smollm2"), ARITHMETICS["stored-fast"]), load_model("smollm2", dtype="stored-fast")


def _sessions(both, **settings):
    from layerplan.app.chat import ChatSession
    from layerplan.lite.chat import LightChatSession

    light, torch_model = both
    return (LightChatSession(light, ChatSettings(**settings)), ChatSession(torch_model, ChatSettings(**settings)))


def test_a_light_conversation_is_the_torch_front_ends(both):
    """Turn by turn: the same ids, the same reply tokens, the same cache reuse, across plan switches
    (both run the conversation again from the kept stream before the first step changed, and say
    so alike), a system message and a reset."""
    light, torch_session = _sessions(both, max_new_tokens=12, system="You are terse.")
    steps = [("reply", "What is the capital of France?"), ("reply", "And of Italy? {braces} é"),
             ("plan", "0-25,20-29"), ("reply", "Name a river there."), ("plan", "full"),
             ("system", None), ("reply", "Thanks."), ("reset", None), ("reply", "Hello again")]
    for kind, argument in steps:
        if kind == "reply":
            assert light.prompt_ids([*light.messages, {"role": "user", "content": argument}]) == \
                torch_session.prompt_ids([*torch_session.messages, {"role": "user", "content": argument}])
            ours, theirs = light.reply(argument), torch_session.reply(argument)
            assert ours.token_ids == theirs.token_ids and ours.text == theirs.text, argument
            assert ours.stop_reason == theirs.stop_reason
            assert (ours.totals.reused, ours.totals.prefilled) == (theirs.totals.reused, theirs.totals.prefilled)
        elif kind == "plan":
            assert light.set_plan(argument) == torch_session.set_plan(argument)
        elif kind == "system":
            light.set_system(argument)
            torch_session.set_system(argument)
        else:
            light.reset()
            torch_session.reset()
    assert light.messages == torch_session.messages
    assert light.stats().turns == torch_session.stats().turns and light.session.replies == 5


@pytest.mark.parametrize("plan", ["skip:mlp=21", "0-25,20-29", "skip:attn=9", "exit:17"])
def test_a_cache_run_again_from_a_kept_stream_holds_what_a_fresh_prefill_writes(both, plan):
    """After /plan, the light cache's slots and kept streams equal a fresh prefill of the new plan
    over the same tokens, bit for bit (the slots before the restart taken over, the rest written
    from the kept stream)."""
    light, _ = _sessions(both, max_new_tokens=8)
    light.reply("Tell me about the moon.")
    light.reply("And the sun?")
    held = list(light.cached)
    note = light.set_plan(plan)
    assert "ran again from step" in note and light.cache.length == len(held)
    fresh = both[0].new_cache(light.plan, light.cache.capacity, light.stream_steps(light.plan))
    both[0].logits(held, fresh, 0)
    for index, (keys, values) in fresh.slot_of.items():
        mine = light.cache.slot_of[index]
        assert np.array_equal(mine[0][:, :len(held)], keys[:, :len(held)]), index
        assert np.array_equal(mine[1][:, :len(held)], values[:, :len(held)]), index
    for index, stream in fresh.streams.items():
        assert np.array_equal(light.cache.streams[index][:len(held)], stream[:len(held)]), index


def test_a_self_draft_follows_the_plan_as_on_the_torch_front_end(both):
    """/draft exit:E then /plan: the draft is made again for the new plan (an exit of it), the
    replies the torch session's; a plan the draft cannot draft for is refused before anything
    changes, in the torch session's words."""
    from layerplan.plan.plan import PlanError

    light, torch_session = _sessions(both, max_new_tokens=10)
    for session in (light, torch_session):
        session.set_draft("exit:20")
        session.set_plan("0-25,20-29")
    assert light.drafter.name == torch_session.drafter.name == "0-25,20-29;exit:20"  # an exit of the new plan
    ours, theirs = light.reply("Name three fruits."), torch_session.reply("Name three fruits.")
    assert ours.token_ids == theirs.token_ids and ours.totals.drafted > 0
    for session in (light, torch_session):
        session.set_plan("full")
        session.set_draft("skip:mlp=3,8")
    errors = []
    for session in (light, torch_session):
        with pytest.raises(PlanError) as error:
            session.set_plan("0-20")
        errors.append(str(error.value))
    assert errors[0] == errors[1] and "not a sub-plan" in errors[0]
    assert light.plan.to_string() == torch_session.plan.to_string() == "full"


def test_what_the_light_session_does_not_run_it_refuses_before_changing_anything(both):
    light, _ = _sessions(both, max_new_tokens=4)
    before = dict(vars(light.settings))
    for spec in ("dynamic:confidence=0.8", "suffix:tree", "exit:8+vocab=512", "online"):
        with pytest.raises(TorchFrontEnd, match="torch front end"):
            light.set_draft(spec)
    from layerplan.plan.plan import PlanError

    with pytest.raises(PlanError, match="only a is loaded"):  # (the torch front end's chat says so too)
        light.set_plan("0-10,b:11-20")
    assert dict(vars(light.settings)) == before
    with pytest.raises(ValueError, match="temperature"):  # a bad value: its own error, as on the torch front end
        light.set_temperature(-1.0)
    light.set_draft("none")
    from layerplan.lite.chat import LightChatSession

    with pytest.raises(TorchFrontEnd):
        LightChatSession(both[0], ChatSettings(draft="dynamic:confidence=0.8"))
    LightChatSession(both[0], ChatSettings(temperature=0.5, seed=1, repetition_penalty=1.2, logit_bias=((5, -1.0),)))


def test_lines_are_read_without_reading_past_them():
    read, write = os.pipe()
    os.write(write, "first line é\nsecond\n".encode())
    os.close(write)
    lines = UnbufferedLines(read)
    assert lines.readline() == "first line é\n"
    assert os.read(read, 100) == b"second\n"  # (still in the pipe, for whoever reads it next)
    assert lines.readline() == ""
    os.close(read)


def test_a_chat_line_the_light_front_end_runs():
    assert light_chat_request(["chat", "-n", "8", "--plan", "0-20"]) is not None
    assert light_chat_request(["chat", "--temp", "0.5"]) is not None  # (weighed once its settings are read)
    for argv in (["chat", "--ctx-size", "512"], ["chat", "--engine", "eager"], ["chat", "--device", "cuda"],
                 ["chat", "--dtype", "float32"], ["chat", "-h"]):
        assert light_chat_request(argv) is None, argv


def _chat(lines: str, tmp_path, *options: str, front_end: str = "", cache=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "LAYERPLAN_FRONT_END": front_end, "TMPDIR": str(tmp_path),
           **({"LAYERPLAN_CACHE": str(cache)} if cache is not None else {})}
    return subprocess.run([sys.executable, "-m", "layerplan.app.launch", "chat", *options], input=lines,
                          capture_output=True, text=True, env=env, timeout=300)


DIALOGUE = ("/system Answer in one sentence.\nWhat is the capital of France?\n/plan 0-25,20-29\n"
            "What river runs through it?\n/plan full\n/reset\nHello\n")
# (the drafted reply samples too: with a seed it drafts by its own rounds, whatever the timings)
HANDED_ON = ("What is the capital of France?\n/temp 0.8\n/seed 7\nTell me about it.\n/draft exit:8+vocab=512\n"
             "And its river?\n/stats\n")


@pytest.mark.parametrize("options", [(), ("--repeat-penalty", "1.3", "--presence-penalty", "0.5", "-l", "28-inf")])
def test_a_piped_light_chat_prints_what_the_torch_front_end_prints(tmp_path, options):
    """A dialogue with a system message, a plan switch and a reset; greedy, and greedy with the
    penalties and a banned token, which the light front end takes too."""
    light, torch_run = (_chat(DIALOGUE, tmp_path, "-n", "16", *options, front_end=fe) for fe in ("", "torch"))
    assert light.returncode == torch_run.returncode == 0, light.stderr
    assert light.stdout == torch_run.stdout and light.stdout.count("\n") == 3
    assert light.stderr.count("loading ") == 1 and "Traceback" not in light.stderr


# lookup and self-drafts run on the light front end (decoding/rounds.py): greedy, then seeded
# sampled (its draft lengths follow its own rounds), an exit of the model, then plain again
DRAFTED = ("/draft suffix\nWrite a Python function that adds two numbers.\nNow one that subtracts them.\n"
           "/temp 0.7\n/seed 2\nAnd one that multiplies them.\n/draft exit:20\nAnd one that divides them.\n"
           "/temp 0\n/draft skip:mlp=3,8|ngram\nAnd one that squares one.\n/draft none\nThanks.\n")


def test_a_light_chat_with_a_draft_prints_what_the_torch_front_end_prints(tmp_path):
    """/draft suffix, exit:20, a skip plan after an n-gram lookup: the conversation stays on the
    light front end, and its replies are the torch front end's."""
    light, torch_run = (_chat(DRAFTED, tmp_path, "-n", "24", front_end=fe) for fe in ("", "torch"))
    assert light.returncode == torch_run.returncode == 0, light.stderr
    assert light.stdout == torch_run.stdout and light.stdout.count("def ") == 6
    assert light.stderr.count("loading ") == 1 and "torch front end" not in light.stderr, light.stderr


def test_a_line_only_torch_runs_hands_the_conversation_on(tmp_path):
    """/draft mid-conversation: the light front end hands on the transcript and the line; the
    sampled reply before (seeded, on the light front end), the drafted one after and the counts
    are the torch front end's own run's."""
    light, torch_run = (_chat(HANDED_ON, tmp_path, "-n", "12", front_end=fe) for fe in ("", "torch"))
    assert light.returncode == torch_run.returncode == 0, light.stderr
    assert light.stdout == torch_run.stdout and light.stdout.count("\n") == 3
    assert ("(a draft that runs a re-quantized copy of the model, a draft head, online skips or a dynamic exit, "
            "or a token tree, runs on the torch front end: starting it, the conversation kept)") in light.stderr
    assert light.stderr.count("loading ") == 2 and "Traceback" not in light.stderr
    assert "was saved with" not in light.stderr
    stats = [line for line in light.stderr.splitlines() if line.startswith("session: ")]
    assert stats and stats[0].startswith("session: 34 tokens")  # (the light replies' 24 counted on)
    assert not list(tmp_path.glob("layerplan-chat-*"))  # the hand-off's folder: removed


def test_a_saved_chat_that_samples_resumes_as_on_the_torch_front_end(tmp_path):
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"format": "layerplan-chat", "version": 1, "model": "smollm2",
                                 "settings": {"temperature": 0.9, "seed": 3, "max_new_tokens": 10},
                                 "messages": [{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": "Hello!"}]}))
    light, torch_run = (_chat("Who are you?\n", tmp_path, "--load", str(saved), front_end=fe) for fe in ("", "torch"))
    assert light.returncode == torch_run.returncode == 0, light.stderr
    assert light.stdout == torch_run.stdout and light.stdout.strip()


def test_a_light_chat_imports_neither_torch_nor_transformers(tmp_path):
    probe = ("import sys\n"
             "from layerplan.app.cli.chatting import light_chat_request, run_light_chat\n"
             "from layerplan.lite.cli import runnable\n"
             "request = light_chat_request(['chat', '-n', '4'])\n"
             "assert runnable(request)\n"
             "assert run_light_chat(request) == 0\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'accelerate')))\n")
    done = subprocess.run([sys.executable, "-c", probe], input="Hello\n/plan 0-20\nAgain\n", capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]" and len(done.stdout.strip().splitlines()) == 3


@pytest.mark.parametrize("name", ["gemma-3-270m-Q4_K_M.gguf", "qwen2.5-coder-1.5b-instruct-Q4_K_M.gguf"])
def test_a_real_gguf_chat_is_the_same_on_both_front_ends(name, tmp_path):
    """Three turns with a system message and a plan switch on a real file (the Gemma 3 270M base
    file has no chat template: 'role: content' lines; Qwen's template, its 151,936-token
    vocabulary): the same replies from both front ends. In `make bench-real`
    (LAYERPLAN_REAL_MODELS names the folder real_models.sh fills), never in the default suite."""
    folder = os.environ.get("LAYERPLAN_REAL_MODELS")
    path = os.path.join(folder or "/nonexistent", name)
    if not os.path.exists(path):
        pytest.skip(f"LAYERPLAN_REAL_MODELS does not name a folder with the real {name}")
    lines = "/system Answer briefly.\nWhat is a prime number?\n/plan skip:mlp=5\nName two.\n/plan full\nThanks!\n"
    light, torch_run = (_chat(lines, tmp_path, "-m", path, "-n", "16", front_end=fe) for fe in ("", "torch"))
    assert light.returncode == torch_run.returncode == 0, light.stderr + torch_run.stderr
    assert light.stdout == torch_run.stdout and light.stdout.strip()
    assert light.stderr.count("loading ") == 1 and "torch front end" not in light.stderr


def _with_template(target, template: str | None):
    """The packaged SmolLM2 file written again with another chat template, or none (every other
    key and tensor as it is)."""
    import gguf
    import numpy as np

    from layerplan.models.gguf_place import default_gguf_path

    source = gguf.GGUFReader(default_gguf_path())
    writer = gguf.GGUFWriter(str(target), "llama")
    for key, field in source.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "tokenizer.chat_template"):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, field.contents())
        else:
            writer.add_key_value(key, field.contents(), kind)
    if template is not None:
        writer.add_chat_template(template)
    for tensor in source.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


# a template that does more than wrap a message: a dated system message of its own (Llama 3.x's kind)
DATED = ("<|im_start|>system\nToday is {{ strftime_now('%Y') }}. Be helpful.<|im_end|>\n"
         "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_does_more_than_wrap_runs_on_the_light_front_end(tmp_path):
    """generate --chat and chat with a template the index keeps no frame of (it writes the date):
    rendered on the light front end, the torch front end's text."""
    import shutil

    from layerplan.files import cache_dir

    path = str(_with_template(tmp_path / "dated.gguf", DATED))
    cache = tmp_path / "cache"  # (the file's index and panels: this test's own, not the user's cache)
    if (cache_dir() / "native").exists():  # the kernels' library, built once per machine
        shutil.copytree(cache_dir() / "native", cache / "native", symlinks=True)
    env = {**os.environ, "TMPDIR": str(tmp_path), "LAYERPLAN_CACHE": str(cache)}
    runs = [subprocess.run([sys.executable, "-m", "layerplan.app.launch", "generate", "Name a color.", "--chat", "-n",
                            "12", "-m", path], capture_output=True, text=True, timeout=300,
                           env={**env, "LAYERPLAN_FRONT_END": fe}) for fe in ("torch", "")]
    assert runs[0].returncode == runs[1].returncode == 0, runs[1].stderr
    assert runs[0].stdout == runs[1].stdout and runs[1].stdout.strip()
    assert runs[1].stderr.count("loading ") == 1
    light, torch_run = (_chat("Name a color.\nAnother?\n", tmp_path, "-m", path, "-n", "12", front_end=fe,
                              cache=cache) for fe in ("", "torch"))
    assert light.stdout == torch_run.stdout and light.stderr.count("loading ") == 1


def test_a_reply_in_role_lines_ends_where_the_model_writes_the_users_turn(tmp_path):
    """A model without a chat template is sent 'role: content' lines, and a base model goes on to
    write the user's next line itself: the reply ends before it (the packaged SmolLM2 without its
    template, greedy, continues " OK\nuser: Say OK." here), on both front ends and the server's
    /v1/chat/completions, and the conversation keeps the reply without it."""
    import httpx

    from layerplan.app.chat import ChatSession
    from layerplan.app.serve import create_app
    from layerplan.engine.load import load_model
    from layerplan.lite.chat import LightChatSession
    from layerplan.lite.model import LiteModel
    from layerplan.lite.request import ARITHMETICS
    from servers import serving

    path = str(_with_template(tmp_path / "bare.gguf", None))
    light, torch_model = LiteModel(Path(path), ARITHMETICS["stored-fast"]), load_model(path, dtype="stored-fast")
    said = [{"role": "user", "content": "Say OK."}, {"role": "assistant", "content": "OK"}] * 2
    for session in (LightChatSession(light, ChatSettings(max_new_tokens=24)),
                    ChatSession(torch_model, ChatSettings(max_new_tokens=24))):
        assert not session.has_chat_template
        session.messages = list(said)
        reply = session.reply("Say OK.")
        assert (reply.text, reply.stop_reason) == (" OK", "stop")
        assert session.messages[-1] == {"role": "assistant", "content": " OK"}
    with serving(create_app(torch_model)) as base:
        answer = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "messages": [*said, {"role": "user", "content": "Say OK."}], "max_tokens": 24, "temperature": 0}).json()
    assert answer["choices"][0]["message"]["content"] == " OK"
    assert answer["choices"][0]["finish_reason"] == "stop"


def test_a_hand_off_that_cannot_start_says_so_and_the_conversation_goes_on(both, tmp_path, monkeypatch):
    """No interpreter to start (or no room for the transcript): one line, the folder removed, the
    light conversation as it was; the loop goes on to the next line."""
    import io

    from layerplan.app.chat_loop import ChatLoop
    from layerplan.app.cli.chatting import hand_off_to_torch
    from layerplan.lite.request import LiteChatRequest

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    light, _ = _sessions(both, max_new_tokens=4)
    out, err = io.StringIO(), io.StringIO()
    loop = ChatLoop(light, io.StringIO("Hi\n/draft exit:8+vocab=512\nAgain\n"), out, err, interactive=False,
                    hand_off=hand_off_to_torch(LiteChatRequest(), interactive=False))
    assert loop.run() == 0
    assert "Error: the torch front end could not be started" in err.getvalue() and "'/draft exit:8+vocab=512' was not run" \
        in err.getvalue()
    assert out.getvalue().count("\n") == 2 and light.settings.draft is None and light.session.replies == 2
    assert not list(tmp_path.glob("layerplan-chat-*"))


def test_a_chat_with_a_second_model_prints_what_the_torch_front_end_prints(tmp_path):
    """--model-b, and /plan switching to a plan that takes layers from it mid-conversation (the
    packaged file as model b too: the one real file the suite holds), a sampled reply; then a
    hand-off keeps it."""
    from layerplan.models.gguf_place import default_gguf_path

    lines = "Hi\n/plan 0-14,b:15-29\nAgain\n/temp 0.5\n/seed 3\nOnce more\n/draft exit:8+vocab=512\nAnd again\n"
    light, torch_run = (_chat(lines, tmp_path, "-n", "8", "--model-b", str(default_gguf_path()), front_end=fe)
                        for fe in ("", "torch"))
    assert light.returncode == torch_run.returncode == 0, light.stderr
    assert light.stdout == torch_run.stdout and light.stdout.count("\n") == 4
    assert "ran again from step 12" in light.stderr and light.stderr.count("as model b") == 2

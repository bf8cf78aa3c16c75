"""`layerplan chat`: the session (KV cache kept between turns, /plan mid-dialogue, drafts, Ctrl-C,
/save and --load) on a tiny random model with a byte tokenizer and a chat template, and the
command driven as a person would: from a pipe (in process, and a real process stopped by SIGINT
mid-reply), in a terminal (tmux send-keys / capture-pane), and on the packaged SmolLM2."""

import json
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from layerplan.app import serve as serving
from layerplan.app.chat import ChatSession
from layerplan.app.cli import main, running
from layerplan.decoding.chat_state import COMMAND_LINE_SETTINGS, ChatSettings, first_changed_step, open_chat, read_saved
from layerplan.decoding.generate import generate
from layerplan.decoding.sampling_params import SamplingParams
from layerplan.decoding.scheduler import Scheduler
from layerplan.engine.load import load_model

LAYERPLAN = str(Path(sys.executable).parent / "layerplan")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tiny_text import save_tiny_with_tokenizer

    return save_tiny_with_tokenizer(tmp_path_factory.mktemp("chat") / "tiny", context=8192)


@pytest.fixture(scope="module", params=["native", "eager"])
def model(folder, request):
    from layerplan.engine.native import native_available

    reason = native_available() if request.param == "native" else None  # None: they run here
    if reason:
        pytest.skip(f"the native kernels do not run here: {reason}")
    return load_model(str(folder), dtype="float32", engine=request.param)


def _fresh(model, session: ChatSession, plan=None, n=12, temperature=0.0, seed=None):
    """A fresh run of the conversation's history so far (its last reply left out): what the
    session's last reply must equal."""
    ids = session.prompt_ids(session.messages[:-1])
    return generate(model, ids, plan=model.plan(plan) if plan else None, max_new_tokens=n,
                    sampling=SamplingParams(temperature), seed=seed)


def test_a_turn_prefills_only_what_is_new_and_equals_a_fresh_run(model):
    session = ChatSession(model, ChatSettings(max_new_tokens=12))
    first = session.reply("hello there")
    assert first.totals.reused == 0 and first.token_ids == _fresh(model, session).token_ids
    second = session.reply("tell me more")
    history = len(session.prompt_ids(session.messages[:-1]))
    assert second.totals.reused > 0 and second.totals.reused + second.totals.prefilled == history
    assert second.token_ids == _fresh(model, session).token_ids
    third = session.reply("and then?")
    assert third.totals.reused > second.totals.reused
    assert third.token_ids == _fresh(model, session).token_ids
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 3
    assert session.stats().session.replies == 3 and session.stats().turns == 3


@pytest.mark.parametrize("stream_every", [1, 4])
@pytest.mark.parametrize("plan", ["skip:attn=1", "0-2,1-2", "exit:2", "skip:attn=0", "full"])
def test_a_plan_switched_mid_dialogue_answers_as_a_fresh_run_of_that_plan(model, plan, stream_every):
    """/plan keeps the cache's slots before the first step it changes and runs the conversation
    again from the last kept stream at or before it (every step's kept: from that very step; every
    4th, of 3 layers: none kept, so from the start); the next replies equal fresh runs."""
    session = ChatSession(model, ChatSettings(max_new_tokens=12), stream_every=stream_every)
    session.reply("hello there")
    session.reply("tell me more")
    note = session.set_plan(plan)
    reply = session.reply("and then?")
    assert reply.token_ids == _fresh(model, session, plan).token_ids
    if plan == "full":  # the same steps: the cache stays
        assert "kept whole" in note and reply.totals.reused > 0
    elif stream_every == 1 and plan != "skip:attn=0":  # (step 0's stream is the embeddings: not kept)
        restart = first_changed_step(model.plan(), model.plan(plan)) if plan != "0-2,1-2" else 2
        assert f"from step {restart}" in note and reply.totals.reused > 0
    else:
        assert "nothing of the cache reused" in note and reply.totals.reused == 0
    # and the turn after goes on from the new plan's cache
    after = session.reply("ok")
    assert after.totals.reused > 0 and after.token_ids == _fresh(model, session, plan).token_ids


@pytest.mark.parametrize("draft", [None, "suffix:tree", "exit:2"])
def test_a_cache_run_again_from_a_kept_stream_holds_what_a_fresh_prefill_of_the_plan_writes(model, draft):
    """After /plan, every slot of the new plan holds (to fp32 rounding of a pass's size) the keys
    and values a fresh prefill of the conversation through that plan writes, the kept ones too:
    the streams followed the cache through drafts, rejected ones and token trees included."""
    from layerplan.engine.runner import forward, new_cache

    session = ChatSession(model, ChatSettings(max_new_tokens=16, draft=draft), stream_every=1)
    session.reply("hello there hello there")
    session.reply("tell me more tell me more")
    session.set_plan("0-2,1-2")
    plan, cache, held = session.plan, session.cache, len(session.cached)
    fresh = new_cache(plan, held + 1)
    forward(model, torch.tensor([session.cached]), plan, fresh)
    assert cache.num_slots == len(plan.steps) and cache.length == held
    for slot in range(len(plan.steps)):
        torch.testing.assert_close(cache.keys[slot][:, :, :held], fresh.keys[slot][:, :, :held], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.values[slot][:, :, :held], fresh.values[slot][:, :, :held], rtol=1e-5,
                                   atol=1e-5)


def test_a_plan_switch_stopped_while_it_runs_the_conversation_again_leaves_no_half_written_cache(model, monkeypatch):
    import layerplan.app.chat as chat_module

    session = ChatSession(model, ChatSettings(max_new_tokens=12), stream_every=1)
    session.reply("hello there")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(chat_module, "run_hidden", interrupted)
    with pytest.raises(KeyboardInterrupt):
        session.set_plan("skip:attn=1")
    monkeypatch.undo()
    assert session.cache is None and session.plan.to_string() == model.plan("skip:attn=1").to_string()
    reply = session.reply("tell me more")
    assert reply.totals.reused == 0 and reply.token_ids == _fresh(model, session, "skip:attn=1").token_ids


def test_first_changed_step(model):
    full = model.plan()
    assert first_changed_step(full, model.plan("full")) is None
    assert first_changed_step(full, model.plan("skip:mlp=2")) == 2
    assert first_changed_step(full, model.plan("exit:2")) == 2
    assert first_changed_step(full, model.plan("0-2,1-2")) == 3
    assert first_changed_step(full, model.plan("skip:attn=0")) == 0


@pytest.mark.parametrize("draft", ["suffix", "ngram", "exit:2", "skip:attn=1"])
def test_drafted_replies_with_the_kept_cache_equal_plain_greedy(model, draft):
    session = ChatSession(model, ChatSettings(max_new_tokens=16))
    session.reply("hello there")
    session.set_draft(draft)
    second = session.reply("tell me more tell me more")
    assert second.totals.reused > 0
    assert second.token_ids == _fresh(model, session, n=16).token_ids
    assert session.reply("more").token_ids == _fresh(model, session, n=16).token_ids
    assert session.stats().session.passes > 0
    session.set_draft("none")
    assert session.drafter is None and session.settings.draft is None


def test_stats_give_the_plans_cost_in_the_probes_full_model_steps(model):
    from layerplan.engine.probe_rows import ProbeRow

    session = ChatSession(model, ChatSettings(max_new_tokens=12, plan="skip:mlp=1", draft="suffix"),
                          probe_row=ProbeRow("native", "float32", 2.0, {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.8}))
    session.reply("hello there")
    stats = session.stats()
    per_pass = stats.session.decode_seconds / stats.session.passes
    assert stats.relative_cost == pytest.approx(per_pass * 1000 / 2.0)
    assert stats.sub_layers == pytest.approx(5 / 6) and stats.plan == "skip:mlp=1" and stats.draft == "suffix"
    text = "\n".join(stats.lines())
    assert "the probe's full-model step (2.00 ms)" in text and "runs 83% of the sub-layers" in text
    assert json.loads(json.dumps(stats.to_dict()))["session"]["replies"] == 1


def test_a_stopped_reply_stays_in_the_conversation_and_the_session_goes_on(model):
    session = ChatSession(model, ChatSettings(max_new_tokens=40))
    pieces = []
    stopped = session.reply("hello there", on_text=pieces.append, should_stop=lambda: len(pieces) >= 3)
    assert stopped.stop_reason == "cancelled" and 0 < len(stopped.token_ids) < 40
    assert session.messages[-1] == {"role": "assistant", "content": stopped.text}
    following = session.reply("go on")
    assert following.token_ids == _fresh(model, session, n=40).token_ids


def test_sampled_replies_follow_from_the_seed(model):
    session = ChatSession(model, ChatSettings(max_new_tokens=12, temperature=0.9, seed=5))
    session.reply("hello")
    reply = session.reply("again")
    assert reply.token_ids == _fresh(model, session, temperature=0.9, seed=5).token_ids


def test_a_draft_length_policy_reaches_every_drafted_reply_and_is_saved(model, tmp_path, monkeypatch):
    """chat's --draft-length (ChatSettings.draft_length): each reply with a draft runs under it,
    /save keeps it, and a seeded sampled conversation with a draft under `fixed` repeats itself
    (the adaptive policy's lengths follow the run's timings)."""
    policies = []
    submit = Scheduler.submit
    monkeypatch.setattr(Scheduler, "submit", lambda self, job: (policies.append(job.draft_length), submit(self, job))[1])
    settings = ChatSettings(max_new_tokens=12, temperature=0.9, seed=5, draft="suffix", draft_length="fixed")
    replies = []
    for _ in range(2):
        session = ChatSession(model, settings)
        replies.append([session.reply(line).token_ids for line in ("hello", "hello again")])
    assert replies[0] == replies[1] and policies == ["fixed"] * 4
    assert read_saved(session.save(tmp_path / "chat.json")).settings.draft_length == "fixed"


def test_a_logit_bias_and_the_output_penalties_shape_replies_as_generates(model, tmp_path):
    """generate's -l and --presence/--frequency-penalty, in a conversation: a reply equals a fresh
    generate with the same settings (the penalties count the reply's own tokens, not the history's);
    a banned token never comes; /save keeps them, -inf too."""
    plain = ChatSession(model, ChatSettings(max_new_tokens=16))
    plain.reply("hello there")
    plain_reply = plain.reply("tell me more")
    banned = plain_reply.token_ids[0]  # (the plain reply's first token)
    settings = ChatSettings(max_new_tokens=16, presence_penalty=1.5, frequency_penalty=0.5,
                            logit_bias=((banned, -float("inf")), (7, 4.0)))
    session = ChatSession(model, settings)
    session.reply("hello there")
    reply = session.reply("tell me more")
    ids = session.prompt_ids(session.messages[:-1])
    fresh = generate(model, ids, max_new_tokens=16, sampling=settings.sampling())
    assert reply.token_ids == fresh.token_ids and banned not in reply.token_ids
    assert reply.token_ids != plain_reply.token_ids
    saved = read_saved(session.save(tmp_path / "biased.json"))
    assert saved.settings == session.settings and saved.settings.logit_bias[0] == (banned, -float("inf"))


def test_the_system_message_and_reset(model):
    session = ChatSession(model, ChatSettings(max_new_tokens=8))
    session.reply("hello")
    session.set_system("be brief")
    reply = session.reply("again")
    assert session.conversation()[0] == {"role": "system", "content": "be brief"}
    assert reply.token_ids == _fresh(model, session, n=8).token_ids
    session.reset()
    assert session.messages == []
    reply = session.reply("hi")
    assert reply.totals.reused > 0  # the template's opening and the system message stay cached
    assert reply.token_ids == _fresh(model, session, n=8).token_ids


def test_save_and_load_resume_the_conversation(model, tmp_path):
    session = ChatSession(model, ChatSettings(max_new_tokens=10, plan="skip:attn=1", draft="suffix"))
    session.reply("hello there")
    session.reply("tell me more")
    path = session.save(tmp_path / "chat.json")
    saved = read_saved(path)
    assert saved.settings == session.settings and saved.messages == session.messages and saved.model == model.name
    resumed = ChatSession(model, saved.settings, saved.messages)
    assert resumed.reply("and then?").token_ids == session.reply("and then?").token_ids
    assert read_saved(path, {"temperature": 0.5}).settings.temperature == 0.5


@pytest.mark.parametrize("content, needle", [
    ("{", "not JSON"),
    ('{"format": "other"}', "not a saved chat"),
    ('{"format": "layerplan-chat", "settings": {"colour": 1}, "messages": []}', "settings"),
    ('{"format": "layerplan-chat", "settings": {}, "messages": [{"role": "robot", "content": "x"}]}', "messages"),
    ('{"format": "layerplan-chat", "settings": {"temperature": -1}, "messages": []}', "temperature"),
    ('{"format": "layerplan-chat", "settings": {"logit_bias": 5}, "messages": []}', "pairs"),
    ('{"format": "layerplan-chat", "settings": {"logit_bias": [[1, 500]]}, "messages": []}', "logit_bias"),
    ('{"format": "layerplan-chat", "settings": {"draft_length": "often"}, "messages": []}', "not a draft length policy"),
])
def test_a_file_that_is_not_a_saved_chat_is_one_line(tmp_path, content, needle):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=needle):
        read_saved(path)


def test_a_full_context_is_one_line_and_the_conversation_stays(folder):
    small = load_model(str(folder), dtype="float32")
    small.hf.config.max_position_embeddings = 40
    session = ChatSession(small, ChatSettings(max_new_tokens=4))
    with pytest.raises(ValueError, match="/reset starts a new one"):
        session.reply("x" * 60)
    assert session.messages == []


def test_a_reply_until_the_context_is_full_takes_all_the_room_left(folder):
    """-n -1 (llama.cpp's: until the context is full) a reply: the cache holds the whole context."""
    from layerplan.decoding.budget import UNTIL_CONTEXT

    small = load_model(str(folder), dtype="float32")
    small.hf.config.max_position_embeddings = 48
    session = ChatSession(small, ChatSettings(max_new_tokens=UNTIL_CONTEXT))
    ids = session.prompt_ids([{"role": "user", "content": "hi"}])
    reply = session.reply("hi")
    assert reply.stop_reason == "length" and len(ids) + len(reply.token_ids) == 48
    with pytest.raises(ValueError, match="or -1"):
        ChatSettings(max_new_tokens=-2)


# ----- the command, from a pipe (in process) --------------------------------------------------------
def _chat(folder, lines, *options):
    runner = CliRunner()
    return runner.invoke(main, ["chat", "-m", str(folder), "--dtype", "float32", "-n", "12", *options],
                         input="".join(f"{line}\n" for line in lines))


def _error_line(result) -> str:
    return [line for line in result.stderr.splitlines() if line.startswith("Error:")]


def test_a_piped_dialogue_gives_a_reply_a_line_and_equals_the_session(folder, tmp_path):
    lines = ["hello there", "/plan skip:attn=1", "tell me more", "/stats", f"/save {tmp_path / 'c.json'}"]
    result = _chat(folder, lines)
    assert result.exit_code == 0, result.output
    model = load_model(str(folder), dtype="float32")
    session = ChatSession(model, ChatSettings(max_new_tokens=12))
    expected = [session.reply("hello there").text]
    session.set_plan("skip:attn=1")
    expected.append(session.reply("tell me more").text)
    assert result.stdout == "".join(f"{text}\n" for text in expected)
    assert "tokens/s" in result.stderr and "tokens per pass" in result.stderr and "last /plan" in result.stderr
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved["settings"]["plan"] == "skip:attn=1" and saved["messages"] == session.messages


def test_bad_commands_get_the_clis_one_line_and_the_session_goes_on(folder, tmp_path):
    lines = ["/bogus", "/plan 7-9", "/plan", "/draft nonsense:1", "/temp -1", "/temp x", "/seed 1.5",
             f"/save {tmp_path}", "hello"]
    result = _chat(folder, lines)
    assert result.exit_code == 0, result.output
    errors = _error_line(result)
    assert len(errors) == 8, result.stderr
    assert "unknown command /bogus" in errors[0]
    assert "Traceback" not in result.output
    assert result.stdout.count("\n") == 1  # the reply to "hello"
    # the same line `layerplan generate` gives for the same plan
    generate_run = CliRunner().invoke(main, ["generate", "-m", str(folder), "--dtype", "float32", "--plan", "7-9", "x"])
    assert generate_run.exit_code == 1 and _error_line(generate_run) == [errors[1]]


def test_load_resumes_and_command_line_options_override(folder, tmp_path):
    path = tmp_path / "c.json"
    first = _chat(folder, ["hello there", "/plan skip:attn=1", f"/save {path}"])
    assert first.exit_code == 0, first.output
    resumed = _chat(folder, ["/stats", "tell me more"], "--load", str(path), "-n", "5")
    assert resumed.exit_code == 0, resumed.output
    assert "plan skip:attn=1" in resumed.stderr
    model = load_model(str(folder), dtype="float32")
    saved = read_saved(path, {"max_new_tokens": 5})
    session = ChatSession(model, saved.settings, saved.messages)
    assert resumed.stdout == session.reply("tell me more").text + "\n"


@pytest.mark.parametrize("options, status, needle", [
    (["--temp", "-1"], 1, "temperature -1.0 is out of range"),
    (["--draft-length", "often"], 2, "'often' is not one of"),
    (["--load", "/dev/zero"], 1, "/dev/zero: not a file"),
    (["--load", "/proc"], 2, "'/proc' is a directory"),
    (["--load", "missing.json"], 1, "missing.json: no such file"),
    (["--load", "BINARY"], 1, "not a text file"),
])
def test_bad_options_are_one_line_before_the_model_loads(folder, tmp_path, options, status, needle):
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    result = _chat(folder, [], *[str(binary) if o == "BINARY" else o for o in options])
    assert result.exit_code == status and needle in result.stderr and len(_error_line(result)) == 1, result.stderr
    assert "loading" not in result.stderr and "Traceback" not in result.output


def test_a_model_without_a_tokenizer_is_one_line_at_the_start(tmp_path):
    from tiny import tiny_hf

    tiny_hf("llama").save_pretrained(tmp_path / "bare")
    result = _chat(tmp_path / "bare", ["hello"])
    assert result.exit_code == 1 and "has no tokenizer" in result.stderr and len(_error_line(result)) == 1
    assert result.stdout == ""


# ----- the command as a process: a pipe stopped by SIGINT, a terminal --------------------------------
LONG_PROMPT = "write a long story"  # the tiny model's greedy reply to it runs to the token limit (6,000 in 3-4 s)


def test_sigint_mid_reply_stops_the_reply_not_the_piped_session(folder):
    process = subprocess.Popen([LAYERPLAN, "chat", "-m", str(folder), "--dtype", "float32", "-n", "6000"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdin.write(f"{LONG_PROMPT}\n".encode())
    process.stdin.flush()
    process.stdout.read(1)  # the reply has begun
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(b"/stats\n", timeout=120)
    assert process.returncode == 0, err.decode()
    assert b"reply stopped after" in err and b"turns 1" in err


TMUX = shutil.which("tmux")


class Terminal:
    """A tmux session running a command in a pane of 200 x 50: send keys, read the screen."""

    def __init__(self, command: list[str], cwd: Path) -> None:
        self.name = f"chat-{uuid.uuid4().hex[:8]}"
        subprocess.run([TMUX, "new-session", "-d", "-s", self.name, "-x", "200", "-y", "50", "-c", str(cwd),
                        " ".join(command)], check=True)

    def keys(self, *keys: str) -> None:
        subprocess.run([TMUX, "send-keys", "-t", self.name, *keys], check=True)

    def screen(self) -> str:
        return subprocess.run([TMUX, "capture-pane", "-p", "-J", "-S", "-200", "-t", self.name],
                              capture_output=True, text=True).stdout

    def wait(self, needle: str, seconds: float = 60.0, count: int = 1) -> str:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            screen = self.screen()
            if screen.count(needle) >= count:
                return screen
            time.sleep(0.1)
        raise AssertionError(f"{needle!r} did not appear {count}x on the screen:\n{self.screen()}")

    def changed(self, screen: str, seconds: float = 60.0) -> str:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            now = self.screen()
            if now != screen:
                return now
            time.sleep(0.02)
        raise AssertionError(f"the screen did not change:\n{screen}")

    def alive(self) -> bool:
        return subprocess.run([TMUX, "has-session", "-t", self.name], capture_output=True).returncode == 0

    def close(self) -> None:
        subprocess.run([TMUX, "kill-session", "-t", self.name], capture_output=True)


@pytest.mark.skipif(TMUX is None, reason="tmux is not installed (`make test` installs it: .ci/install-tmux)")
def test_a_person_at_a_terminal(folder, tmp_path):
    saved = tmp_path / "t.json"
    done = tmp_path / "done"
    command = [LAYERPLAN, "chat", "-m", str(folder), "--dtype", "float32", "-n", "800", f"; touch {done}"]
    terminal = Terminal(command, tmp_path)
    try:
        terminal.wait("/help lists the commands")
        terminal.keys("-l", "/temp 0")
        terminal.keys("Enter")
        terminal.wait("temperature 0")
        terminal.keys("-l", "helo")  # line editing: back one character, add the missing l
        terminal.keys("Left", "l", "Enter")
        terminal.keys("-l", "/stats")
        terminal.keys("Enter")
        terminal.wait("tokens in the cache", seconds=120)  # (typed during the reply, read after it)
        terminal.keys("-l", "/plan skip:attn=1")
        terminal.keys("Enter")
        terminal.wait("no stream is kept before it")
        terminal.keys("-l", LONG_PROMPT)
        terminal.keys("Enter")
        asked = terminal.wait(f"> {LONG_PROMPT}")
        terminal.changed(asked)  # the reply has begun
        terminal.keys("C-c")  # mid-reply: the reply stops, the session stays
        terminal.wait("reply stopped after")
        terminal.keys("Up", "Up", "Enter")  # the history: "/plan skip:attn=1" again
        terminal.wait("skip:attn=1: the same steps as before")
        terminal.keys("-l", "/bogus")
        terminal.keys("Enter")
        terminal.wait("Error: unknown command /bogus")
        terminal.keys("-l", f"/save {saved}")
        terminal.keys("Enter")
        terminal.wait("saved to")
        terminal.keys("C-d")
        deadline = time.monotonic() + 30
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert done.exists(), terminal.screen()
    finally:
        terminal.close()
    messages = json.loads(saved.read_text())["messages"]
    assert [m["content"] for m in messages if m["role"] == "user"] == ["hello", LONG_PROMPT]
    assert json.loads(saved.read_text())["settings"]["plan"] == "skip:attn=1"


# ----- the packaged model -------------------------------------------------------------------------------
def test_smollm2_dialogue_with_a_plan_switch_equals_fresh_runs(smollm2):
    session = ChatSession(smollm2, ChatSettings(max_new_tokens=16))
    session.reply("What is the capital of France?")
    assert "Paris" in session.messages[-1]["content"]
    second = session.reply("And of Italy?")
    assert second.totals.reused > 0
    assert second.token_ids == _fresh(smollm2, session, n=16).token_ids
    session.set_plan("skip:attn=20-24")
    third = session.reply("And of Spain?")
    assert third.token_ids == _fresh(smollm2, session, "skip:attn=20-24", n=16).token_ids
    session.set_draft("suffix")
    fourth = session.reply("Thanks.")
    assert fourth.token_ids == _fresh(smollm2, session, "skip:attn=20-24", n=16).token_ids


def test_a_model_without_a_chat_template_says_how_its_prompts_go(folder, tmp_path, monkeypatch):
    """A base model's file carries no chat template: chat sends 'role: content' lines and
    generate --chat the bare prompt, and both say so (the reply is a continuation, not an answer);
    serve says so as it starts."""
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    result = _chat(bare, ["hello"])
    assert result.exit_code == 0 and "no chat template" in result.stderr, result.output
    assert "no chat template" not in _chat(folder, ["hello"]).stderr
    for model, said in ((bare, True), (folder, False)):
        generated = CliRunner().invoke(main, ["generate", "hi", "-m", str(model), "--dtype", "float32", "-n", "2",
                                              "--chat"])
        assert generated.exit_code == 0, generated.output
        assert ("--chat: this model has no chat template" in generated.stderr) == said

    def listening_only(loaded, host, port, on_listening, **_):  # (the server's start, not its serving)
        on_listening(host, port, 1)

    monkeypatch.setattr(serving, "serve", listening_only)
    monkeypatch.setattr(running, "freeze", lambda: None)  # (a frozen object of this process is never freed)
    for model, said in ((bare, True), (folder, False)):
        served = CliRunner().invoke(main, ["serve", "-m", str(model), "--dtype", "float32"])
        assert served.exit_code == 0 and f"serving '{model.name}'" in served.stderr, served.output
        assert ("no chat template: /v1/chat/completions sends" in served.stderr) == said


def test_a_conversation_opens_with_the_command_lines_settings_over_its_files(tmp_path):
    """open_chat (both front ends'): without a file the command line's settings, the full model for
    no plan; with one the file's, but for the settings the command line named; a note where the
    file was saved with another model."""
    given = {name: getattr(ChatSettings(), name) for name in COMMAND_LINE_SETTINGS}
    fresh = open_chat({**given, "plan": None, "temperature": 0.5}, [])
    assert fresh.settings.plan == "full" and fresh.settings.temperature == 0.5 and fresh.messages == []
    assert fresh.model_note("any") is None
    path = tmp_path / "saved.json"
    path.write_text(json.dumps({"format": "layerplan-chat", "model": "tiny",
                                "settings": {"plan": "skip:mlp=1", "temperature": 0.7, "seed": 3},
                                "messages": [{"role": "user", "content": "hi"}]}))
    opened = open_chat({**given, "temperature": 0.2, "seed": 9}, ["temperature"], path)
    assert (opened.settings.plan, opened.settings.temperature, opened.settings.seed) == ("skip:mlp=1", 0.2, 3)
    assert opened.messages == [{"role": "user", "content": "hi"}]
    assert opened.model_note("tiny") is None
    assert opened.model_note("other") == f"{path} was saved with tiny; resuming with other"

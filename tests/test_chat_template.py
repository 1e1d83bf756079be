"""Chat-template kwargs end to end: one setting renders every command's conversations (a small
template that branches on ``enable_thinking``), checkpoints record it, and a drafter run under
other kwargs than it was trained with warns."""

from __future__ import annotations

import dataclasses
import json
import shlex

import httpx
import pytest
from test_interop import build
from test_regenerate import write_prompts
from test_training import make_recipe, register_probe, write_conversations
from tiny_models import assert_cli_error, run_cli, tiny_qwen3, tiny_tokenizer
from transformers import PreTrainedTokenizerBase

from dspec_cli.core import plugins
from dspec_cli.core.chat_template import DEFAULT_KWARGS, parse_kwargs
from dspec_cli.core.data import load_conversations
from dspec_cli.core.errors import DspecError
from dspec_cli.runtime.target import Target
from dspec_cli.training.data import tokenize_conversations
from dspec_cli.training.recipes import Recipe, load_recipe
from dspec_cli.training.regenerate import RegenerateOptions
from dspec_cli.training.regenerate_server import ServerOptions, regenerate_with_servers

STUB = "<think>\n\n</think>\n\n"  # what the template adds when enable_thinking is false
THINKING = '{"enable_thinking": true}'
# Qwen3-like: with enable_thinking false, an empty think block opens the answer (generation prompt
# and last assistant turn); assistant turns before the last lose their thinking
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.last and enable_thinking is false %}" + STUB + "{% endif %}"
    "{% if m['role'] == 'assistant' and not loop.last and '</think>' in m['content'] %}"
    "{{ m['content'].split('</think>')[-1].lstrip() }}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is false %}" + STUB + "{% endif %}"
    "{% endif %}"
)


def thinking_tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def saved_target(tmp_path_factory, name: str, tokenizer):
    """A tiny Qwen3 target folder with ``tokenizer`` (and its chat template)."""
    path = tmp_path_factory.mktemp(name) / "target"
    tiny_qwen3().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return saved_target(tmp_path_factory, "thinking", thinking_tokenizer())


@pytest.fixture
def rendered(monkeypatch) -> list[str]:
    """The text of every chat-template rendering while the test runs."""
    texts: list[str] = []
    original = PreTrainedTokenizerBase.apply_chat_template

    def spy(self, conversation, *args, **kwargs):
        texts.append(str(original(self, conversation, *args, **{**kwargs, "tokenize": False, "return_dict": False})))
        return original(self, conversation, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "apply_chat_template", spy)
    return texts


@pytest.fixture(scope="module")
def probe():
    register_probe()
    yield
    plugins.pm.unregister(name="test-linear-probe")


@pytest.fixture(scope="module")
def thinking_drafter(tmp_path_factory, target_dir):
    """A dspark-markov checkpoint whose config.json records thinking-mode training."""
    path = tmp_path_factory.mktemp("drafter") / "dspark"
    drafter = build("dspark-markov", Target.load(str(target_dir)), markov_rank=16)
    drafter.chat_template_kwargs = {"enable_thinking": True}
    drafter.save_pretrained(path)
    return path


# -- the setting -------------------------------------------------------------------------------------


def test_kwargs_parse_as_one_json_object():
    assert parse_kwargs(THINKING) == {"enable_thinking": True} and parse_kwargs("{}") == {}
    with pytest.raises(DspecError, match="not valid JSON"):
        parse_kwargs("{enable_thinking: true}")
    with pytest.raises(DspecError, match="must be a JSON object"):
        parse_kwargs("[1]")


@pytest.mark.parametrize("command", [
    ["bench", "--drafter", "prompt-lookup"],
    ["calibrate", "--drafter", "draft-model", "--output", "x"],
    ["export", "ckpt", "--format", "vllm", "--output", "x"],
    ["train", "--recipe", "r.toml"],
    ["data", "regenerate", "--prompts", "p.jsonl", "--output", "o.jsonl"],
])
def test_bad_kwargs_are_one_line_errors(command, capsys):
    assert_cli_error([*command, "--chat-template-kwargs", "{oops"], capsys, "--chat-template-kwargs: not valid JSON")


def test_recipe_table_is_the_whole_set_of_kwargs(tmp_path):
    assert Recipe().chat_template == DEFAULT_KWARGS
    path = tmp_path / "r.toml"
    path.write_text('[chat_template]\nenable_thinking = true\nreasoning_effort = "high"\n')
    recipe = load_recipe(path)
    assert recipe.chat_template == {"enable_thinking": True, "reasoning_effort": "high"}
    assert Recipe.from_dict(recipe.to_dict()).chat_template == recipe.chat_template
    assert load_recipe(path, ["chat_template.enable_thinking=false"]).chat_template["enable_thinking"] is False
    path.write_text("[chat_template]\n")
    assert load_recipe(path).chat_template == {}
    path.write_text('chat_template = "thinking"\n')
    with pytest.raises(DspecError, match=r"\[chat_template\] must be a JSON object / TOML table"):
        load_recipe(path)


def test_the_thinking_recipe_is_the_qwen3_8b_recipe_in_thinking_mode():
    from pathlib import Path

    recipes = Path(__file__).resolve().parent.parent / "recipes"
    plain, thinking = (load_recipe(recipes / d / "dspark-markov.toml") for d in ("qwen3-8b", "qwen3-8b-thinking"))
    assert thinking.chat_template == {"enable_thinking": True} and plain.chat_template == DEFAULT_KWARGS
    assert (thinking.regenerate.temperature, thinking.regenerate.top_p, thinking.regenerate.top_k) == (0.6, 0.95, 20)
    assert (thinking.target, thinking.drafter_section, thinking.train) == (plain.target, plain.drafter_section, plain.train)


def test_the_embedded_target_template_ignores_the_flag(capsys):
    target = Target.load()
    assert target.render_prompt("hi", {"enable_thinking": True}) == target.render_prompt("hi")
    # the shipped drafter (trained with the default) runs in "thinking mode" without a warning:
    # on this template both render the same text
    code, stdout, err = run_cli(["bench", "--drafter", "dspark", "--chat-template-kwargs", THINKING,
                                 "--num-prompts", "2", "--max-new-tokens", "8"], capsys)
    assert code == 0 and "dspark" in stdout and not _warnings(err), err


# -- every command renders in the chosen mode ----------------------------------------------------------


def _prompt_commands(target_dir, tmp_path) -> dict[str, list[str]]:
    prompts = write_prompts(tmp_path / "prompts.jsonl", 2)
    small = ["--max-new-tokens", "4", "--block-size", "2"]
    return {
        "bench": ["bench", "--target", str(target_dir), "--drafter", "prompt-lookup", "--num-prompts", "2", *small],
        "calibrate": ["calibrate", "--drafter", "draft-model", "--checkpoint", str(target_dir), "--target",
                      str(target_dir), "--num-prompts", "2", *small, "--force", "--output", str(tmp_path / "cal")],
        "regenerate": ["data", "regenerate", "--target", str(target_dir), "--prompts", str(prompts), "--output",
                       str(tmp_path / "out.jsonl"), "--max-new-tokens", "4", "--device", "cpu"],
    }


@pytest.mark.parametrize("command", ["bench", "calibrate", "regenerate"])
@pytest.mark.parametrize("thinking", [False, True])
def test_prompts_render_in_the_chosen_mode(target_dir, tmp_path, rendered, capsys, command, thinking):
    args = _prompt_commands(target_dir, tmp_path)[command] + (["--chat-template-kwargs", THINKING] if thinking else [])
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert rendered and all(t.endswith("<|im_start|>assistant\n" + ("" if thinking else STUB)) for t in rendered)
    if command == "regenerate":  # second turns carry the first answer as history
        assert any(t.count("<|im_start|>assistant") == 2 for t in rendered)


def test_server_regeneration_sends_and_checks_the_kwargs(target_dir, tmp_path):
    tok = thinking_tokenizer()
    bodies: list[dict] = []

    def serve(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        body = json.loads(request.content)
        bodies.append(body)
        n = len(tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True, return_dict=False,
                                        **body.get("chat_template_kwargs", {})))
        content = "<think>\nlong thoughts\n</think>\n\nanswer"
        return httpx.Response(200, json={"choices": [{"message": {"content": content}, "finish_reason": "length"}],
                                         "usage": {"prompt_tokens": n, "completion_tokens": 5}})

    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    opts = RegenerateOptions(prompts=str(prompts), output=tmp_path / "out.jsonl", target=str(target_dir),
                             max_new_tokens=5, top_k=0, chat_template_kwargs={"enable_thinking": True})
    stats = regenerate_with_servers(opts, ServerOptions(["http://fake"], concurrency=1),
                                    transport=httpx.MockTransport(serve))
    assert stats.written == 2 and stats.truncated == 2  # every answer stopped at max_tokens
    assert all(b["chat_template_kwargs"] == {"enable_thinking": True} for b in bodies)
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [x["chat_template_kwargs"] for x in lines] == [{"enable_thinking": True}] * 2
    with pytest.raises(DspecError, match="out.jsonl was regenerated with chat-template kwargs"):
        regenerate_with_servers(dataclasses.replace(opts, chat_template_kwargs={}), ServerOptions(["http://fake"]),
                                transport=httpx.MockTransport(serve))
    # the probe's token count (checked against --target's template) passes only under the same kwargs
    tok.chat_template = TEMPLATE.replace("{% if enable_thinking is false %}", "{% if enable_thinking %}")
    opts = dataclasses.replace(opts, output=tmp_path / "other.jsonl")
    with pytest.raises(DspecError, match="serves another tokenizer or chat template"):
        regenerate_with_servers(opts, ServerOptions(["http://fake"]), transport=httpx.MockTransport(serve))


def test_server_answers_without_their_thinking_are_refused(target_dir, tmp_path):
    tok = thinking_tokenizer()

    def serve(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        body = json.loads(request.content)
        n = len(tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True, return_dict=False,
                                        **body.get("chat_template_kwargs", {})))
        message = {"content": "answer", "reasoning_content": "thoughts"}  # a server with --reasoning-parser
        return httpx.Response(200, json={"choices": [{"message": message}], "usage": {"prompt_tokens": n}})

    opts = RegenerateOptions(prompts=str(write_prompts(tmp_path / "p.jsonl", 1)), output=tmp_path / "o.jsonl",
                             target=str(target_dir), max_new_tokens=5, top_k=0, chat_template_kwargs={"enable_thinking": True})
    with pytest.raises(DspecError, match="without --reasoning-parser"):
        regenerate_with_servers(opts, ServerOptions(["http://fake"]), transport=httpx.MockTransport(serve))


def test_training_text_renders_in_the_mode_and_splits_rewritten_turns():
    from dspec_cli.core.data import Conversation

    tok = thinking_tokenizer()
    one = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nAnswer one"}]
    two = one + [{"role": "user", "content": "And?"}, {"role": "assistant", "content": "<think>\nso\n</think>\n\nTwo"}]
    convs = [Conversation("a", one, "f:1"), Conversation("b", two, "f:2")]
    plain = tokenize_conversations(convs, tok, 512, 1, "f")
    thinking = tokenize_conversations(convs, tok, 512, 1, "f", {"enable_thinking": True})
    assert STUB in tok.decode(plain.sample(0)[0]) and STUB not in tok.decode(thinking.sample(0)[0])
    # b's first answer loses its thinking once a user turn follows: one sample per answer instead
    assert thinking.sample_ids == ["a", "b/1", "b/2"] and thinking.split == 1
    for i, answer in ((1, one[1]["content"]), (2, two[3]["content"])):
        ids, mask = thinking.sample(i)
        assert tok.decode([int(t) for t, m in zip(ids, mask, strict=True) if m]) == answer + "<|im_end|>\n"
    full = len(thinking.sample(0)[0])
    short = tokenize_conversations(convs[:1], tok, full - 2, 1, "f", {"enable_thinking": True})
    assert short.truncated == 1 and short.num_tokens == full - 2


# -- training records the mode; runs under another one warn ----------------------------------------------


def test_training_renders_records_and_cards_the_mode(target_dir, tmp_path, rendered, probe, capsys):
    data = write_conversations(tmp_path / "conv.jsonl", n=4)
    recipe = make_recipe(tmp_path, target_dir, data, max_steps=1, save_every=0)
    configs = {}
    for name, extra in (("plain", []), ("thinking", ["--chat-template-kwargs", THINKING])):
        rendered.clear()
        code, _, err = run_cli(["train", "--recipe", str(recipe), "--output", str(tmp_path / name), *extra], capsys)
        assert code == 0, err
        assert rendered
        assert all(STUB not in t for t in rendered) == (name == "thinking")
        configs[name] = json.loads((tmp_path / name / "config.json").read_text())
    assert configs["plain"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert configs["thinking"]["chat_template_kwargs"] == {"enable_thinking": True}
    card = (tmp_path / "thinking" / "README.md").read_text()
    assert '`{"enable_thinking": true}` (thinking mode)' in card
    assert f"--chat-template-kwargs '{THINKING}'" in card
    assert "--chat-template-kwargs" not in (tmp_path / "plain" / "README.md").read_text().split("## Use")[1]
    saved = json.loads((tmp_path / "thinking" / "checkpoints" / "step_1" / "recipe.json").read_text())
    assert saved["chat_template"] == {"enable_thinking": True}  # --resume keeps the mode


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    """A target whose template (plain ChatML) reads no kwargs."""
    return saved_target(tmp_path_factory, "chatml", tiny_tokenizer())


def test_training_warns_on_data_regenerated_under_other_kwargs(target_dir, chatml_dir, tmp_path, probe, capsys):
    data = write_conversations(tmp_path / "conv.jsonl", n=4)
    lines = [json.loads(x) for x in data.read_text().splitlines()]
    data.write_text("".join(json.dumps({**x, "chat_template_kwargs": {"enable_thinking": True}} if i else x) + "\n"
                            for i, x in enumerate(lines)))  # the first line records none
    for target, extra, warns in ((target_dir, [], True), (target_dir, ["--chat-template-kwargs", THINKING], False),
                                 (chatml_dir, [], False)):
        out = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
        recipe = make_recipe(tmp_path, target, data, max_steps=1, save_every=0)
        code, _, err = run_cli(["train", "--recipe", str(recipe), "--output", str(out), *extra], capsys)
        assert code == 0, err
        warned = [line for line in err.splitlines() if "regenerated with chat-template kwargs" in line]
        assert warned == ([f"Warning: 3 of 4 training conversation(s) ({data}) were regenerated with chat-template "
                           f"kwargs {THINKING} (thinking mode), not {{\"enable_thinking\": false}}: the drafter "
                           f"learns answers the target gave under other kwargs (pass --chat-template-kwargs "
                           f"'{THINKING}' to match)"] if warns else []), err
        assert f"| data regenerated with | `{THINKING}` (3 conversations) |" in (out / "README.md").read_text()


def test_regenerate_takes_the_recipes_mode(target_dir, tmp_path, rendered, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", 1)
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[target]\nname = "{target_dir}"\n[chat_template]\nenable_thinking = true\n'
                      f'[data]\npath = "{tmp_path / "out.jsonl"}"\n[regenerate]\nprompts = "{prompts}"\n')
    code, _, err = run_cli(["data", "regenerate", "--recipe", str(recipe), "--max-new-tokens", "3", "--device", "cpu"],
                           capsys)
    assert code == 0, err
    assert rendered and all(t.endswith("<|im_start|>assistant\n") for t in rendered)
    assert_cli_error(["data", "regenerate", "--recipe", str(recipe), "--chat-template-kwargs", "{}"], capsys,
                     'trains with chat-template kwargs {"enable_thinking": true}, not {}')


def test_regenerated_lines_record_the_kwargs_and_a_resume_keeps_them(target_dir, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    args = _prompt_commands(target_dir, tmp_path)["regenerate"]
    write_prompts(tmp_path / "prompts.jsonl", 3)
    code, _, err = run_cli([*args, "--limit", "2", "--chat-template-kwargs", THINKING], capsys)
    assert code == 0, err
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["chat_template_kwargs"] for x in lines] == [{"enable_thinking": True}] * 2
    assert [c.chat_template_kwargs for c in load_conversations(out)] == [{"enable_thinking": True}] * 2
    # resuming under other kwargs: refused, the file (a partial last line included) left as it was
    with out.open("a") as f:
        f.write('{"id": "cut')
    before = out.read_bytes()
    assert_cli_error(args, capsys, f'{out} was regenerated with chat-template kwargs {THINKING}, not '
                     '{"enable_thinking": false}: give another --output, or --chat-template-kwargs '
                     f"'{THINKING}' to continue it")
    assert out.read_bytes() == before
    # lines written without the field are accepted, whatever the kwargs
    out.write_text("".join(json.dumps({k: v for k, v in x.items() if k != "chat_template_kwargs"}) + "\n"
                           for x in lines))
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert [c.chat_template_kwargs for c in load_conversations(out)] == [None, None, {"enable_thinking": False}]


def test_recorded_kwargs_must_be_objects(tmp_path):
    from dspec_cli.core.calibration import Calibration

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"turns": ["hi"], "chat_template_kwargs": "thinking"}) + "\n")
    with pytest.raises(DspecError, match=r"data.jsonl:1: chat_template_kwargs must be a JSON object"):
        load_conversations(data)
    cal = tmp_path / "calibration.json"
    cal.write_text(json.dumps({"temperatures": [1.0], "chat_template_kwargs": ["thinking"]}))
    with pytest.raises(DspecError, match=r"calibration.json: chat_template_kwargs: should be an object"):
        Calibration.load(cal)
    cal.write_text(json.dumps({"temperatures": [1.0], "chat_template_kwargs": None}))
    assert Calibration.load(cal).chat_template_kwargs is None  # fitted on recorded traces: not known


def test_checkpoints_without_the_field_were_trained_in_the_default_mode(thinking_drafter, target_dir, tmp_path):
    from dspec_cli.checkpoints.config import CheckpointConfig

    assert CheckpointConfig.read(thinking_drafter).chat_template_kwargs == {"enable_thinking": True}
    config = json.loads((thinking_drafter / "config.json").read_text())
    for value, expected in ((None, None), (..., dict(DEFAULT_KWARGS))):
        folder = tmp_path / str(value)
        folder.mkdir()
        if value is ...:
            config.pop("chat_template_kwargs", None)
        else:
            config["chat_template_kwargs"] = value
        (folder / "config.json").write_text(json.dumps(config))
        assert CheckpointConfig.read(folder).chat_template_kwargs == expected


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if "was trained with chat-template kwargs" in line]


def test_calibration_records_the_kwargs_and_runs_under_others_warn(thinking_drafter, target_dir, tmp_path, capsys):
    # a thinking-mode drafter calibrated on non-thinking prompts (the training warning aside)
    cal = tmp_path / "cal"
    code, _, err = run_cli(["calibrate", "--drafter", "dspark-markov", "--checkpoint", str(thinking_drafter),
                            "--target", str(target_dir), "--num-prompts", "1", "--max-new-tokens", "3", "--force",
                            "--verify", "token", "--output", str(cal)], capsys)  # the rule SGLang's export needs
    assert code == 0 and len(_warnings(err)) == 1, err
    assert json.loads((cal / "calibration.json").read_text())["chat_template_kwargs"] == {"enable_thinking": False}
    bench = ["bench", "--drafter", "dspark-markov", "--checkpoint", str(cal), "--target", str(target_dir),
             "--num-prompts", "1", "--max-new-tokens", "3", "--block-size", "4"]
    export = ["export", str(cal), "--target", str(target_dir)]
    for args, warns in (([*bench, "--chat-template-kwargs", THINKING], True), (bench, False),
                        ([*export, "--format", "sglang", "--output", str(tmp_path / "sg"), "--chat-template-kwargs",
                          THINKING], True),
                        ([*export, "--format", "vllm", "--output", str(tmp_path / "vl"), "--chat-template-kwargs",
                          THINKING], False)):  # vLLM calibrates at startup: the file is not used
        code, _, err = run_cli(args, capsys)
        assert code == 0, err
        fitted = [line for line in err.splitlines() if "was fitted with chat-template kwargs" in line]
        assert fitted == ([f"Warning: the calibration of drafter dspark-markov ({cal / 'calibration.json'}) was "
                           f'fitted with chat-template kwargs {{"enable_thinking": false}} (non-thinking mode), not '
                           f"{THINKING}: its temperatures fit the confidences of other prompts (pass "
                           f"--chat-template-kwargs '{{\"enable_thinking\": false}}' to match)"] if warns else []), err
        assert len(_warnings(err)) == (THINKING not in args), err  # the training warning, when trained otherwise


def test_bench_calibrate_and_export_warn_under_other_kwargs(thinking_drafter, target_dir, tmp_path, capsys):
    base = {
        "bench": ["bench", "--drafter", "dspark-markov", "--checkpoint", str(thinking_drafter), "--target",
                  str(target_dir), "--num-prompts", "1", "--max-new-tokens", "3", "--block-size", "2"],
        "calibrate": ["calibrate", "--drafter", "dspark-markov", "--checkpoint", str(thinking_drafter), "--target",
                      str(target_dir), "--num-prompts", "1", "--max-new-tokens", "3", "--block-size", "2", "--force"],
        "export": ["export", str(thinking_drafter), "--format", "vllm", "--target", str(target_dir)],
    }
    for name, args in base.items():
        for i, extra in enumerate(([], ["--chat-template-kwargs", THINKING])):
            out = ["--output", str(tmp_path / f"{name}{i}")] if name != "bench" else []
            code, stdout, err = run_cli([*args, *out, *extra], capsys)
            assert code == 0, err
            warned = _warnings(err)
            if extra:
                assert not warned, err
            else:
                assert len(warned) == 1 and "(thinking mode), not {\"enable_thinking\": false}" in warned[0], err
            if name == "export":  # the server renders requests that send no kwargs as the export says
                argv = shlex.split(stdout.strip())
                served = argv[argv.index("--default-chat-template-kwargs") + 1]
                assert json.loads(served) == ({"enable_thinking": True} if extra else {"enable_thinking": False})

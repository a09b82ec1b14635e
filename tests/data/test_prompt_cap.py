"""prepare_data's prompt cap (--max-prompt-tokens with --tokenizer) on a tiny local whitespace tokenizer.

The tokenizer maps every whitespace-separated word to one token and puts `<s>` in front only when special
tokens are added, so the expected lengths below are word counts of the rendered template, made by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from openrlhf_growmtp.cli import prepare_data
from openrlhf_growmtp.data import loaders

# One user turn renders as "<|user|> {content} <|assistant|>" (the last word only with the generation prompt).
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def rendered_words(problem: str) -> int:
    """Tokens of a DAPO prompt under CHAT_TEMPLATE: its content's words plus the two role markers."""
    content = f"{loaders.DAPO_MATH_PREFIX}{problem}{loaders.DAPO_MATH_SUFFIX}"
    return len(content.split()) + 2


# The cap sits exactly on the "at-cap" problem: one word more is over it, even without the `<s>` in front.
CAP = rendered_words("one two three four five")
PROBLEMS = {"short": "one", "at-cap": "one two three four five", "over": "one two three four five six",
            "far-over": " ".join(["word"] * 40)}


def dapo_row(index: str, problem: str) -> dict:
    """One DAPO-Math-17k row, in the published layout."""
    content = f"{loaders.DAPO_MATH_PREFIX}{problem}{loaders.DAPO_MATH_SUFFIX}"
    return {"data_source": "math_dapo", "prompt": [{"content": content, "role": "user"}], "ability": "MATH",
            "reward_model": {"ground_truth": "1", "style": "rule-lm"}, "extra_info": {"index": index}}


def save_tokenizer(path: Path, chat_template: str | None) -> str:
    backend = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> str:
    return save_tokenizer(tmp_path_factory.mktemp("chat-tokenizer"), CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory) -> str:
    return save_tokenizer(tmp_path_factory.mktemp("plain-tokenizer"), None)


@pytest.fixture
def dapo_jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "dapo.jsonl"
    path.write_text("".join(json.dumps(dapo_row(index, problem)) + "\n" for index, problem in PROBLEMS.items()))
    return path


def test_expected_lengths_bracket_the_cap():
    assert [rendered_words(p) for p in PROBLEMS.values()] == [CAP - 4, CAP, CAP + 1, CAP + 35]


def test_prompts_over_the_cap_are_dropped_and_prompts_at_the_cap_kept(tmp_path, dapo_jsonl, chat_tokenizer, capsys):
    out = tmp_path / "out.jsonl"
    code = prepare_data.main(["dapo-math", str(dapo_jsonl), str(out),
                              "--max-prompt-tokens", str(CAP), "--tokenizer", chat_tokenizer])
    assert code == 0
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["short", "at-cap"]
    printed = capsys.readouterr().out
    assert "dapo-math: read 4 rows, wrote 2 rows" in printed
    assert f"dapo-math: dropped 2 prompts over {CAP} tokens (longest kept: {CAP})" in printed


def test_no_cap_keeps_every_prompt(tmp_path, dapo_jsonl, capsys):
    out = tmp_path / "out.jsonl"
    assert prepare_data.main(["dapo-math", str(dapo_jsonl), str(out)]) == 0
    assert len(out.read_text().splitlines()) == len(PROBLEMS)
    assert "dropped" not in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--max-prompt-tokens", "1024"], "--max-prompt-tokens and --tokenizer go together"),
    (["--tokenizer", "some/model"], "--max-prompt-tokens and --tokenizer go together"),
    (["--max-prompt-tokens", "0", "--tokenizer", "some/model"], "--max-prompt-tokens must be at least 1"),
])
def test_cap_needs_a_tokenizer_and_a_positive_length(tmp_path, dapo_jsonl, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        prepare_data.main(["dapo-math", str(dapo_jsonl), str(tmp_path / "out.jsonl"), *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_tokenizer_without_chat_template_fails_before_the_source_is_read(tmp_path, plain_tokenizer, capsys):
    out = tmp_path / "out.jsonl"
    code = prepare_data.main(["dapo-math", str(tmp_path / "no-such-source.jsonl"), str(out),
                              "--max-prompt-tokens", "8", "--tokenizer", plain_tokenizer])
    err = capsys.readouterr().err
    assert code == 2
    assert plain_tokenizer in err and "no chat template" in err
    assert "no-such-source" not in err
    assert not list(tmp_path.glob("out.jsonl*"))


def test_unloadable_tokenizer_is_named(tmp_path, dapo_jsonl, capsys):
    missing = str(tmp_path / "no" / "such" / "tokenizer")
    code = prepare_data.main(["dapo-math", str(dapo_jsonl), str(tmp_path / "out.jsonl"),
                              "--max-prompt-tokens", "8", "--tokenizer", missing])
    assert code == 2
    assert f"could not load the tokenizer {missing!r}" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_all_prompts_dropped_exits_2_and_leaves_the_old_file(tmp_path, dapo_jsonl, chat_tokenizer, capsys):
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    code = prepare_data.main(["dapo-math", str(dapo_jsonl), str(out),
                              "--max-prompt-tokens", str(CAP - 5), "--tokenizer", chat_tokenizer])
    assert code == 2
    assert f"all 4 prompts are over {CAP - 5} tokens" in capsys.readouterr().err
    assert out.read_text() == "old\n"
    assert not (tmp_path / "out.jsonl.tmp").exists()


def test_failed_tokenizer_check_leaves_the_old_file(tmp_path, dapo_jsonl, plain_tokenizer):
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    code = prepare_data.main(["dapo-math", str(dapo_jsonl), str(out),
                              "--max-prompt-tokens", "8", "--tokenizer", plain_tokenizer])
    assert code == 2
    assert out.read_text() == "old\n"

"""The reasoning world (third CPU world): its task, vocabulary, reward, spec and build, without Ray (fast)."""

from __future__ import annotations

import importlib.util
import json
import random
from dataclasses import replace
from math import log
from pathlib import Path

import pytest
import torch

from growmtp_lab.recipes import WORLDS
from growmtp_lab.worlds import demo_world, task
from growmtp_lab.worlds.reasoning_world import ReasoningWorldSpec, build_reasoning_world
from openrlhf_growmtp.trainer.args import policy_steps_per_rl_step

REPO = Path(__file__).resolve().parents[2]
SPEC = ReasoningWorldSpec()


def strip_connectives(text: str) -> tuple[list[str], str]:
    """(the connective of each column's step, the text without them)."""
    steps, answer = text.rsplit(" , A ", 1)
    forks, rest = [], []
    for step in steps.split(" , "):
        fork, body = step.split(" ", 1)
        forks.append(fork)
        rest.append(body)
    return forks, " , ".join(rest) + " , A " + answer


def test_each_column_starts_with_one_of_the_32_connectives_and_the_rest_is_the_demos_solution():
    assert len(SPEC.connectives) == len(set(SPEC.connectives)) == 32
    problem_rng, rng = random.Random(5), random.Random(6)
    seen = set()
    for _ in range(300):
        a, b = task.sample_problem(problem_rng, SPEC.min_digits, SPEC.max_digits)
        text = task.solution_text(a, b, connectives=SPEC.connectives, rng=rng)
        forks, rest = strip_connectives(text)
        assert len(forks) == len(str(a)) and set(forks) <= set(SPEC.connectives)
        assert rest == task.solution_text(a, b)
        seen.update(forks)
    assert seen == set(SPEC.connectives)  # ~1,350 uniform draws reach every one of the 32


def test_without_connectives_the_rng_is_untouched():
    # the demo world's pretraining passes its one rng to every batch: a draw here would change its weights
    rng = random.Random(0)
    before = rng.getstate()
    assert task.solution_text(347, 589, rng=rng) == task.solution_text(347, 589)
    demo_world.make_batch(task.make_tokenizer(), [(12, 34), (567, 890)], demo_world.WorldSpec().connective_words(),
                          rng)
    assert rng.getstate() == before


def test_the_vocabulary_has_4096_ids_and_every_symbol_and_connective_is_one_id():
    words = SPEC.vocabulary()
    tokenizer = task.make_tokenizer(words)
    assert len(words) == len(set(words)) == len(tokenizer) == 4096
    unk = tokenizer.convert_tokens_to_ids("<unk>")
    for word in task.SYMBOLS + list(SPEC.connectives):
        ids = tokenizer(word, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and ids[0] != unk and tokenizer.decode(ids) == word
    text = task.prompt_text(98765, 43210) + " " + task.solution_text(98765, 43210, connectives=SPEC.connectives,
                                                                      rng=random.Random(1))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert unk not in ids and tokenizer.decode(ids) == text
    assert task.vocabulary(32) == task.VOCAB == demo_world.WorldSpec().vocabulary()  # the demo's, as it was
    assert not set(SPEC.connectives) & set(task.VOCAB)


def test_the_reward_reads_the_answer_after_A_through_the_connectives():
    path = WORLDS["reasoning"].reward
    loaded = importlib.util.spec_from_file_location("reasoning_reward_under_test", path)  # as OpenRLHF loads it
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    tokenizer = task.make_tokenizer(SPEC.vocabulary())
    prompt = task.prompt_text(347, 589)
    solution = task.solution_text(347, 589, connectives=SPEC.connectives, rng=random.Random(2))
    query = tokenizer.decode(tokenizer(f"{prompt} {solution} <eos>", add_special_tokens=False)["input_ids"])
    wrong = query.replace("A 9 3 6", "A 9 3 7")
    assert wrong != query
    out = module.reward_func([query, wrong], [prompt, prompt], ["936", "936"])
    assert out["rewards"].tolist() == [1.0, 0.0] and out["scores"].tolist() == [1.0, 0.0]


def test_the_reasoning_spec_has_its_own_key_and_the_demos_is_unchanged():
    demo = demo_world.WorldSpec()
    assert SPEC.key() != demo.key()
    assert replace(SPEC, seed=1).key() != SPEC.key()
    assert replace(SPEC, connectives=SPEC.connectives[:-1] + ("lastly",)).key() != SPEC.key()
    # the kept ablation results are filed under the demo world's cache name: a new key would orphan them
    assert (REPO / "docs/data/ablations/runs" / f"{demo.prefix}-{demo.key()}").is_dir()
    assert (SPEC.vocab_size, SPEC.num_layers, SPEC.hidden_size, SPEC.head_dim, SPEC.min_digits, SPEC.max_digits) == (
        4096, 8, 256, 32, 3, 6)


def test_the_accuracy_estimate_weights_each_drawn_connective_by_the_number_of_connectives(monkeypatch):
    # the forks are counted from the batch's ids: one per column, none in the prompt; the log-probs are stubbed
    # (a random model's would underflow exp)
    tokenizer = task.make_tokenizer(SPEC.vocabulary())
    problems = [(123, 456), (98765, 12345)]
    batch = demo_world.make_batch(tokenizer, problems, SPEC.connectives, random.Random(3))
    summed = torch.tensor([-12.0, -20.0])
    monkeypatch.setattr(demo_world, "solution_logprobs", lambda model, ids, attention, target: summed)
    weighted = demo_world.expected_accuracy(None, tokenizer, batch, SPEC.connectives)
    columns = torch.tensor([len(str(a)) for a, _ in problems])
    assert weighted == pytest.approx(float((summed + columns * log(32)).exp().mean()), rel=1e-6)
    assert demo_world.expected_accuracy(None, tokenizer, batch) == pytest.approx(float(summed.exp().mean()), rel=1e-6)


def test_a_tiny_reasoning_world_builds_with_its_vocabulary_prompts_and_head(tmp_path):
    spec = replace(SPEC, hidden_size=64, num_layers=1, batch_size=4, warmup_steps=1, max_steps=2, eval_every=1,
                   eval_problems=4, num_prompts=20)
    world = build_reasoning_world(tmp_path, spec, log=lambda *_: None)
    assert world.root == tmp_path / f"reasoning-{spec.key()}"
    config = json.loads((world.policy / "config.json").read_text())
    assert config["vocab_size"] == 4096 and config["num_hidden_layers"] == 1
    assert (world.head / "model.safetensors").is_file() and world.info["pretrain"]["steps"] == 2
    rows = [json.loads(line) for line in world.prompts.read_text().splitlines()]
    assert len(rows) == 20
    for row in rows:
        left, right = row["input"].rstrip(" =").split(" + ")
        assert 3 <= len(left.split()) <= 6 and int(row["label"]) == int(left.replace(" ", "")) + int(
            right.replace(" ", ""))
    assert build_reasoning_world(tmp_path, spec, log=print).digest() == world.digest()  # cached, not rebuilt


def test_the_reasoning_recipes_take_one_policy_step_per_rl_step_at_k5_and_top64():
    for recipe in WORLDS["reasoning"].recipes.values():
        assert (recipe.k, recipe.topk) == (5, 64)
        assert policy_steps_per_rl_step(recipe.prompts_per_step, recipe.samples_per_prompt, recipe.train_batch,
                                        recipe.epochs) == 1

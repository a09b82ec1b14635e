"""The ingredients of `--train.full_determinism_enable` (`openrlhf_growmtp/reproducibility.py`): their
defaults, the override that measures them one at a time, and what switching each one off leaves out."""

from __future__ import annotations

import contextvars

import pytest
import torch
from vllm import SamplingParams

from helpers.trainer import cpu_support  # noqa: F401  (the CPU layer before openrlhf is imported)
from openrlhf_growmtp import reproducibility
from openrlhf_growmtp.reproducibility import INGREDIENTS, OVERRIDE_ENV, ingredient, overrides, unfilled
from openrlhf_growmtp.trainer import rollout_order


def test_every_ingredient_is_on_but_the_gradient_bucket_fill_on_cpu(monkeypatch):
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    monkeypatch.setattr(reproducibility.cpu_support, "needed", lambda: True)
    assert [name for name in INGREDIENTS if not ingredient(name)] == ["fill_gradient_bucket"]
    monkeypatch.setattr(reproducibility.cpu_support, "needed", lambda: False)  # a GPU run: upstream's torch setup
    assert all(ingredient(name) for name in INGREDIENTS)


def test_the_override_switches_single_ingredients_and_refuses_what_it_does_not_know(monkeypatch):
    monkeypatch.setenv(OVERRIDE_ENV, "request_seeds=0, fill_gradient_bucket=1")
    assert overrides() == {"request_seeds": False, "fill_gradient_bucket": True}
    assert not ingredient("request_seeds") and ingredient("fill_gradient_bucket") and ingredient("seeded_drafts")
    for bad in ("request_seed=0", "request_seeds=off", "request_seeds"):
        monkeypatch.setenv(OVERRIDE_ENV, bad)
        with pytest.raises(ValueError, match=OVERRIDE_ENV):
            overrides()
    with pytest.raises(KeyError):
        ingredient("everything")


def test_unfilled_turns_the_fill_off_only_while_it_runs():
    seen = []

    def allocate(fail=False):
        seen.append(torch.utils.deterministic.fill_uninitialized_memory)
        if fail:
            raise RuntimeError("allocation failed")
        return "buffer"

    saved = torch.utils.deterministic.fill_uninitialized_memory
    try:
        torch.utils.deterministic.fill_uninitialized_memory = True
        assert unfilled(allocate)() == "buffer"
        with pytest.raises(RuntimeError):
            unfilled(allocate)(fail=True)
        assert seen == [False, False] and torch.utils.deterministic.fill_uninitialized_memory
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = saved


def test_without_request_seeds_a_request_keeps_its_params_and_still_gets_its_priority():
    base = SamplingParams(temperature=1.0, max_tokens=4)

    def dispatch():  # in a context of its own, as the rollout actor's request tasks run
        rollout_order.start_dispatch((7, 3))
        seeded, unseeded = rollout_order.number_request(base), rollout_order.number_request(base, seeded=False)
        return seeded, unseeded, rollout_order._PRIORITY.get()

    seeded, unseeded, priority = contextvars.copy_context().run(dispatch)
    assert seeded.seed == rollout_order.request_seed(7, 3, 0) and unseeded is base and base.seed is None
    assert priority == 3 * rollout_order.SAMPLES_PER_DISPATCH + 1

"""Reproducible rollouts (`trainer/rollout_order.py`): numbered dispatches, a seed and a priority per request,
paused admission, and the step's samples back in dispatch order."""

from __future__ import annotations

import asyncio
import itertools
import random
from types import SimpleNamespace

import pytest
from vllm import SamplingParams

from helpers.trainer import cpu_support  # noqa: F401  (the CPU layer before openrlhf is imported)
from openrlhf_growmtp.trainer import rollout_order, samples_generator
from openrlhf_growmtp.trainer.rollout_order import ORDER_KEY, NumberedEngines, PrioritizedLLM, request_seed


def test_request_seeds_are_distinct_stable_and_follow_the_run_seed():
    seeds = {request_seed(42, d, s) for d in range(200) for s in range(16)}
    assert len(seeds) == 200 * 16 and all(0 <= x < 2**63 for x in seeds)
    assert request_seed(43, 7, 3) not in seeds
    # stable: a resumed run, or another process of the same one, draws the same seed (str hashing is salted per
    # process, so a seed made from hash() would differ between these two interpreters)
    import subprocess
    import sys

    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('order', sys.argv[1]); "
            "module = sys.modules['order'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
            "print(module.request_seed(42, 7, 3))")
    for salt in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code, rollout_order.__file__], capture_output=True, text=True,
                             env={"PYTHONHASHSEED": salt}, check=True).stdout
        assert int(out) == request_seed(42, 7, 3)


class FakeEngine:
    """A Ray actor handle's shape: `method.remote(...)` returns what the call would (here, the call itself)."""

    def __init__(self, name, log):
        self.name, self.log = name, log
        for method in ("generate_responses", "get_num_unfinished_requests", "growmtp_hold", "growmtp_release"):
            setattr(self, method, SimpleNamespace(remote=lambda *a, _m=method, **kw: self._call(_m, a, kw)))

    def _call(self, method, args, kwargs):
        self.log.append((self.name, method, args, kwargs))
        return 0 if method == "get_num_unfinished_requests" else (self.name, method, kwargs)


def test_numbered_engines_number_dispatches_in_order_and_count_each_engines_requests():
    log = []
    engines = [FakeEngine("a", log), FakeEngine("b", log)]
    numbers = itertools.count()
    numbered = NumberedEngines(engines, 42, numbers)
    handles = numbered.handles
    assert handles[1].get_num_unfinished_requests.remote() == 0  # everything else is the engine's own
    for engine, samples in ((0, 4), (1, 4), (0, 4), (0, 2)):
        handles[engine].generate_responses.remote(prompt="p", num_samples=samples)
    dispatched = [(name, kw["growmtp_dispatch"]) for name, method, _, kw in log if method == "generate_responses"]
    assert dispatched == [("a", (42, 0)), ("b", (42, 1)), ("a", (42, 2)), ("a", (42, 3))]
    assert numbered.requests == [10, 4]
    NumberedEngines(engines, 42, numbers).handles[1].generate_responses.remote(num_samples=1)
    assert log[-1][3]["growmtp_dispatch"] == (42, 4)  # numbers go on across dispatch rounds


def test_a_numbered_dispatch_gives_each_request_a_seed_and_a_priority_and_nothing_outside_it():
    class LLM:
        def generate(self, prompt, params, request_id=None, **kwargs):
            return params, kwargs.get("priority")

    llm, base = PrioritizedLLM(LLM()), SamplingParams(temperature=1.0, max_tokens=4)

    async def dispatch(number):
        token = rollout_order.start_dispatch((7, number))
        try:  # the executor's tasks: each one's context copies the dispatch's
            return await asyncio.gather(*[asyncio.create_task(request()) for _ in range(3)])
        finally:
            rollout_order.end_dispatch(token)

    async def request():
        return llm.generate("prompt", rollout_order.number_request(base), request_id="x")

    first, second = asyncio.run(dispatch(0)), asyncio.run(dispatch(1))
    assert [p.seed for p, _ in first] == [request_seed(7, 0, s) for s in range(3)]
    assert [priority for _, priority in first + second] == sorted(priority for _, priority in first + second)
    assert len({priority for _, priority in first + second}) == 6 and base.seed is None
    params, priority = llm.generate("prompt", rollout_order.number_request(base))
    assert params is base and priority is None


def make_generator(ordered: bool, engines):
    args = SimpleNamespace(train=SimpleNamespace(full_determinism_enable=ordered, seed=42),
                           rollout=SimpleNamespace(n_samples_per_prompt=2))
    return samples_generator.OrderedSamplesGenerator(strategy=SimpleNamespace(args=args), prompts_dataloader=None,
                                                     eval_dataloader=None, tokenizer=None, vllm_engines=engines)


def test_a_step_is_dispatched_between_hold_and_release_and_its_samples_come_back_in_order(monkeypatch):
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    log = []
    engines = [FakeEngine("a", log), FakeEngine("b", log)]
    monkeypatch.setattr(samples_generator.ray, "get", lambda refs: refs)

    def upstream_dispatch(self, prompts, labels, *, images=None, **kwargs):
        return [self.vllm_engines[i % 2].generate_responses.remote(prompt=p, num_samples=2)
                for i, p in enumerate(prompts)]

    monkeypatch.setattr(SamplesGenerator, "_dispatch_prompts_to_vllm", upstream_dispatch)
    generator = make_generator(True, engines)
    generator._dispatch_prompts_to_vllm(["p0", "p1", "p2"], ["", "", ""])
    assert [(name, method) for name, method, _, _ in log] == [
        ("a", "growmtp_hold"), ("b", "growmtp_hold"), ("a", "generate_responses"), ("b", "generate_responses"),
        ("a", "generate_responses"), ("a", "growmtp_release"), ("b", "growmtp_release")]
    assert [args for _, method, args, _ in log if method == "growmtp_release"] == [(4,), (2,)]
    assert generator.vllm_engines == engines  # the numbered handles only for the dispatch

    finished = [SimpleNamespace(growmtp_order=(d, s)) for d in range(3) for s in range(2)]
    random.Random(0).shuffle(finished)
    monkeypatch.setattr(SamplesGenerator, "_generate_vllm", lambda self, *a, **kw: (list(finished), 3, False))
    experiences, consumed, _ = generator._generate_vllm(None, 3, False)
    assert [e.growmtp_order for e in experiences] == [(d, s) for d in range(3) for s in range(2)] and consumed == 3

    plain = make_generator(False, engines)  # without full determinism: upstream's, untouched
    log.clear()
    plain._dispatch_prompts_to_vllm(["p0"], [""])
    assert [method for _, method, _, _ in log] == ["generate_responses"]
    assert "growmtp_dispatch" not in log[0][3]
    assert [e.growmtp_order for e in plain._generate_vllm(None, 3, False)[0]] == [e.growmtp_order for e in finished]


def test_without_ordered_scheduling_a_step_is_numbered_but_never_held(monkeypatch):
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    from openrlhf_growmtp.reproducibility import OVERRIDE_ENV

    log = []
    engines = [FakeEngine("a", log), FakeEngine("b", log)]
    monkeypatch.setenv(OVERRIDE_ENV, "ordered_scheduling=0")
    monkeypatch.setattr(samples_generator.ray, "get", lambda refs: refs)
    monkeypatch.setattr(SamplesGenerator, "_dispatch_prompts_to_vllm", lambda self, prompts, labels, **kw: [
        self.vllm_engines[i % 2].generate_responses.remote(prompt=p, num_samples=2) for i, p in enumerate(prompts)])
    make_generator(True, engines)._dispatch_prompts_to_vllm(["p0", "p1"], ["", ""])
    assert [(name, method, kw["growmtp_dispatch"]) for name, method, _, kw in log] == [
        ("a", "generate_responses", (42, 0)), ("b", "generate_responses", (42, 1))]


def test_the_order_reaches_the_experience():
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SamplesGenerator, "_process_response_into_experience", lambda self, r, **kw: SimpleNamespace())
        experience = make_generator(True, [])._process_response_into_experience({ORDER_KEY: [3, 1]})
    assert experience.growmtp_order == (3, 1)


def test_an_engine_is_released_only_once_every_request_of_the_step_has_reached_it():
    from openrlhf_growmtp.trainer.rollout_actor import RolloutActor

    events = []

    class Engine:  # AsyncLLM's pause/resume and the output processor's count of registered requests
        def __init__(self):
            self.registered = 0
            self.output_processor = SimpleNamespace(get_num_unfinished_requests=lambda: self.registered)

        async def pause_generation(self, mode, clear_cache):
            events.append(("pause", mode, clear_cache))

        async def resume_generation(self):
            events.append(("resume", self.registered))

    actor = RolloutActor.__new__(RolloutActor)
    actor.llm = Engine()

    async def requests_arrive():
        for _ in range(3):
            await asyncio.sleep(0.02)
            actor.llm.registered += 1

    async def step():
        await actor.growmtp_hold()
        await asyncio.gather(requests_arrive(), actor.growmtp_release(3))
        with pytest.raises(TimeoutError, match="1 of 2 requests"):
            actor.llm.registered = 1
            await actor.growmtp_release(2, timeout_s=0.05)

    asyncio.run(step())
    assert events == [("pause", "keep", False), ("resume", 3)]


def test_a_request_refused_while_the_engine_is_held_fails_the_release_at_once(monkeypatch):
    """A request that vLLM refuses (an empty prompt, say) never reaches the held engine: the release says so
    instead of waiting out its timeout for a count that cannot be reached."""
    from openrlhf_growmtp.trainer.rollout_actor import RolloutActor

    async def refused(self, *args, **kwargs):
        raise ValueError("The decoder prompt cannot be empty")

    monkeypatch.setattr(RolloutActor.__mro__[1], "generate_responses", refused)
    actor = RolloutActor.__new__(RolloutActor)
    actor.llm = SimpleNamespace(output_processor=SimpleNamespace(get_num_unfinished_requests=lambda: 0),
                                pause_generation=lambda mode, clear_cache: asyncio.sleep(0))

    async def step():
        await actor.growmtp_hold()
        return await asyncio.gather(actor.generate_responses(growmtp_dispatch=(0, 0)),
                                    actor.growmtp_release(1, timeout_s=60.0), return_exceptions=True)

    dispatched, released = asyncio.run(step())
    assert isinstance(dispatched, ValueError)
    assert isinstance(released, RuntimeError) and "refused before it reached the engine" in str(released)
    assert "decoder prompt cannot be empty" in str(released)  # not a TimeoutError after 60 s

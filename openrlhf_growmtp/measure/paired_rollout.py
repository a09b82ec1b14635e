"""The paired rollout measurement: autoregressive and speculative generation of the same prompts by the same
policy, with the same engine settings, alternated, timed per generated token.

    result = measure_checkpoint(model_dir, head_dir, depth, prompts, PairedDesign(pairs=6, max_tokens=64),
                                engine_kwargs={"dtype": "float32", "enforce_eager": True, "max_num_seqs": 2})
    result["speedup"]      # {"estimate": median over pairs, "low", "high": its order-statistic interval, ...}
    combine([result, ...])  # one figure from several measurement processes, its interval over processes

Two engines live side by side: a plain vLLM engine (`ar`) and a GrowMTP engine drafting `depth` tokens per
cycle with the checkpoint's head (`spec`, record capture on by default, as in an RL rollout). After one untimed
warm-up generate each, `pairs` pairs run, one generate of each arm per pair, the order alternating (ABBA...:
autoregressive first in even pairs, speculative first in odd ones), so a drift of the machine's speed weighs on
both arms alike. Each generate is timed from outside (the speculative one's record collection included, as an
RL rollout pays it) and divided by the tokens it generated: the two arms sample different responses, of
different lengths, so seconds per generated token is what compares like with like. The speedup of a pair is
the autoregressive arm's seconds per token over the speculative arm's; one process's result is the median
over pairs with its distribution-free interval (`intervals.median_interval`), τ the speculative arm's tokens
per cycle over all of its timed generates.

One process's interval covers the spread between its pairs, not what moves between processes (the machine's
state, the engines' start): two measurements of one checkpoint minutes apart differed by more than either's
interval. A figure to keep comes from several processes, fresh engines each (`growmtp-paired-rollout
--processes`, default 3), combined by `combine`: the mean of the processes' medians with its Student-t
interval over processes (`intervals.process_interval`), the processes' own figures beside it.

The autoregressive engine is matched to the speculative one: vLLM's V1 model runner and synchronous
scheduling, which record capture needs. `baseline="default"` gives it vLLM's defaults instead (on a GPU the
V2 runner and asynchronous scheduling): it is then built in a process of its own (`engine_process`), since
the speculative engine fixes this process's runner. Every result records each engine's runner, scheduling and
`max_num_seqs` as the engine resolved them (`engines`).
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from typing import Callable

from .intervals import median_interval, process_interval

ARMS = ("ar", "spec")


@dataclass(frozen=True)
class PairedDesign:
    pairs: int = 6  # timed pairs after one untimed warm-up generate per arm
    max_tokens: int = 64
    temperature: float = 1.0
    ignore_eos: bool = False  # True: every request generates max_tokens (lengths equal in both arms)

    def __post_init__(self):
        if self.pairs < 2:
            raise ValueError(f"pairs={self.pairs}: an interval needs at least 2 pairs")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens}: must be at least 1")
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature}: speculative decoding here verifies by rejection "
                             "sampling, which needs temperature > 0")

    @staticmethod
    def order(pair: int) -> tuple[str, str]:
        """Autoregressive first in even pairs, speculative first in odd ones."""
        return ARMS if pair % 2 == 0 else ARMS[::-1]


def run_pairs(generate: dict[str, Callable[[], dict]], design: PairedDesign,
              clock: Callable[[], float] = time.perf_counter) -> list[dict]:
    """One row per timed generate: {"pair", "position", "arm", "wall_s", "tokens", ...what generate returned}.
    `generate[arm]()` runs one generate of the fixed prompt set and returns at least {"tokens": generated}."""
    missing = set(ARMS) - set(generate)
    if missing:
        raise ValueError(f"no generate for arm(s) {sorted(missing)}")
    for arm in design.order(0):  # warm-up: the first generate of an engine pays its one-off costs
        generate[arm]()
    rows = []
    for pair in range(design.pairs):
        for position, arm in enumerate(design.order(pair)):
            began = clock()
            out = generate[arm]()
            wall = clock() - began
            if out.get("tokens", 0) <= 0:
                raise RuntimeError(f"the {arm} arm generated no tokens in pair {pair}")
            rows.append({"pair": pair, "position": position, "arm": arm, "wall_s": wall, **out})
    return rows


def summarize(rows: list[dict]) -> dict:
    """Per-token seconds per arm, the speedup per pair and its median with its 95% interval (`median_interval`), τ."""
    per_pair: dict[int, dict[str, float]] = {}
    for row in rows:
        per_pair.setdefault(row["pair"], {})[row["arm"]] = row["wall_s"] / row["tokens"]
    complete = [pair for pair, arms in sorted(per_pair.items()) if set(arms) == set(ARMS)]
    if len(complete) < 2:
        raise ValueError(f"{len(complete)} complete pair(s): a paired summary needs at least 2")
    speedups = [per_pair[p]["ar"] / per_pair[p]["spec"] for p in complete]
    spec = [row for row in rows if row["arm"] == "spec"]
    cycles = sum(row.get("cycles", 0) for row in spec)
    accepted = sum(row.get("accepted", 0) for row in spec)
    return {
        "pairs": len(complete),
        "speedup": median_interval(speedups).as_dict(),
        "speedup_per_pair": speedups,
        "ar_s_per_token": median_interval([per_pair[p]["ar"] for p in complete]).as_dict(),
        "spec_s_per_token": median_interval([per_pair[p]["spec"] for p in complete]).as_dict(),
        "ar_tokens_per_generate": sum(r["tokens"] for r in rows if r["arm"] == "ar") / len(complete),
        "spec_tokens_per_generate": sum(r["tokens"] for r in spec) / len(complete),
        # tokens per cycle, the bonus token included: 1 + accepted drafts per cycle
        "tau": 1 + accepted / cycles if cycles else None,
        "cycles": cycles,
    }


def combine(results: list[dict]) -> dict:
    """One paired figure from several measurement processes' results (each `measure_checkpoint`'s): the speedup
    and each arm's seconds per token as the mean of the processes' medians with a Student-t interval over
    processes, the processes' own medians beside them (`*_per_process`), τ over every speculative generate."""
    if len(results) < 2:
        raise ValueError(f"{len(results)} measurement process(es): combining needs at least 2")
    figure = {}
    for name, arm in (("speedup", None), ("ar_s_per_token", "ar"), ("spec_s_per_token", "spec")):
        groups = [r["speedup_per_pair"] if arm is None else _per_pair(r["rows"], arm) for r in results]
        interval, medians = process_interval(groups)
        figure[name] = interval.as_dict()
        figure[f"{name}_per_process"] = medians
    cycles = sum(r["cycles"] for r in results)
    accepted = sum(row.get("accepted", 0) for r in results for row in r["rows"] if row["arm"] == "spec")
    return {**figure, "processes": len(results), "pairs": sum(r["pairs"] for r in results),
            "tau": 1 + accepted / cycles if cycles else None, "cycles": cycles,
            "tau_per_process": [r["tau"] for r in results],
            "ar_tokens_per_generate": sum(r["ar_tokens_per_generate"] for r in results) / len(results),
            "spec_tokens_per_generate": sum(r["spec_tokens_per_generate"] for r in results) / len(results)}


def _per_pair(rows: list[dict], arm: str) -> list[float]:
    """Seconds per generated token of `arm`'s timed generates, in pair order."""
    return [row["wall_s"] / row["tokens"] for row in sorted(rows, key=lambda r: r["pair"]) if row["arm"] == arm]


def _ar_engine(model: str, engine_kwargs: dict, baseline: str):
    """The autoregressive arm's engine and a function that runs one generate: matched, in this process (the
    speculative engine's runner, set in it, and its synchronous scheduling); default, in its own process."""
    if baseline == "default":
        from functools import partial

        from .engine_process import EngineProcess, PlainEngine

        engine = EngineProcess(partial(PlainEngine, model, dict(engine_kwargs)))
        return engine, engine.facts, engine.generate_tokens, engine.close
    from vllm import LLM, SamplingParams

    from vllm_patches.engine_facts import close_llm, engine_facts
    from vllm_patches.settings import v1_sync_engine_kwargs

    llm = LLM(model=model, **v1_sync_engine_kwargs(dict(engine_kwargs)))

    def generate_tokens(inputs: list[dict], sampling: dict) -> int:
        outputs = llm.generate(inputs, SamplingParams(**sampling), use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    return llm, engine_facts(llm), generate_tokens, lambda: close_llm(llm)


def measure_checkpoint(model: str, head: str, depth: int, prompts: list[list[int]], design: PairedDesign,
                       engine_kwargs: dict, capture: bool = True, baseline: str = "matched",
                       ar_max_num_seqs: int | None = None) -> dict:
    """The paired measurement of one checkpoint in this process (module docstring):
    {"design", "rows", "engines", **summarize(rows)}. `ar_max_num_seqs`: the autoregressive engine at another
    concurrency than the speculative one's."""
    from vllm import SamplingParams

    from vllm_patches.engine import SpecEngine
    from vllm_patches.engine_facts import engine_facts

    if baseline not in ("matched", "default"):
        raise ValueError(f"baseline={baseline!r}: 'matched' or 'default'")
    if not prompts or any(not p for p in prompts):
        raise ValueError("the prompt set is empty or holds an empty prompt")
    sampling = {"temperature": design.temperature, "max_tokens": design.max_tokens, "ignore_eos": design.ignore_eos}
    params = SamplingParams(**sampling)
    inputs = [{"prompt_token_ids": list(map(int, p))} for p in prompts]
    ar_kwargs = dict(engine_kwargs) if ar_max_num_seqs is None else {**engine_kwargs, "max_num_seqs": ar_max_num_seqs}
    # the default baseline's engine first: its process starts before this one's runner is fixed (it is spawned
    # without it either way); the speculative engine's settings put this process on the V1 runner, which the
    # matched autoregressive engine then shares
    ar = ar_facts = ar_close = None
    if baseline == "default":
        ar, ar_facts, ar_tokens, ar_close = _ar_engine(model, ar_kwargs, baseline)
    spec = None
    try:
        spec = SpecEngine(model, head, depth, capture=capture, **engine_kwargs)
        if ar is None:
            ar, ar_facts, ar_tokens, ar_close = _ar_engine(model, ar_kwargs, baseline)
        engines = {"ar": ar_facts, "spec": engine_facts(spec.llm)}

        def spec_generate() -> dict:
            result = spec.generate(prompts, params)
            acceptance = result.metrics.acceptance
            return {"tokens": result.metrics.generated_tokens, "cycles": int(acceptance.cycles),
                    "accepted": int(acceptance.accepted_tokens)}

        rows = run_pairs({"ar": lambda: {"tokens": ar_tokens(inputs, sampling)}, "spec": spec_generate}, design)
    finally:
        if spec is not None:
            spec.close()
        if ar_close is not None:
            ar_close()
        gc.collect()
    return {"design": asdict(design), "depth": depth, "capture": capture, "baseline": baseline,
            "requests": len(prompts), "engine_kwargs": engine_kwargs, "ar_engine_kwargs": ar_kwargs,
            "engines": engines, "rows": rows, **summarize(rows)}


def scan_concurrency(model: str, head: str, depth: int, prompts: list[list[int]], design: PairedDesign,
                     engine_kwargs: dict, levels: dict[str, list[int]], repeats: int = 2,
                     capture: bool = True) -> dict[str, dict[int, float]]:
    """Each arm's generated tokens per second at each of its `levels` of concurrency (max_num_seqs), the best of
    `repeats` generates after a warm-up, one engine at a time: the scan that picks each arm's best regime."""
    from vllm import SamplingParams

    from vllm_patches.engine import SpecEngine

    params = SamplingParams(temperature=design.temperature, max_tokens=design.max_tokens,
                            ignore_eos=design.ignore_eos)
    inputs = [{"prompt_token_ids": list(map(int, p))} for p in prompts]
    found: dict[str, dict[int, float]] = {"ar": {}, "spec": {}}
    sampling = {"temperature": design.temperature, "max_tokens": design.max_tokens, "ignore_eos": design.ignore_eos}
    for arm in ARMS:
        for level in levels.get(arm, []):
            kwargs = {**engine_kwargs, "max_num_seqs": level}
            if arm == "spec":
                engine = SpecEngine(model, head, depth, capture=capture, **kwargs)
                generate = lambda: engine.generate(prompts, params).metrics.generated_tokens  # noqa: E731
                close = engine.close
            else:
                _, _, ar_tokens, close = _ar_engine(model, kwargs, "matched")
                generate = lambda: ar_tokens(inputs, sampling)  # noqa: E731
            try:
                generate()
                best = 0.0
                for _ in range(repeats):
                    began = time.perf_counter()
                    tokens = generate()
                    best = max(best, tokens / (time.perf_counter() - began))
                found[arm][level] = best
            finally:
                close()
                gc.collect()
    return found

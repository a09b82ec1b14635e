"""Weights into the engines through Ray, with every policy rank told the outcome (CPU policy sync, every head sync).

Rank 0 holds the gathered weights and sends them; the other ranks wait. If an engine refused them, or died,
and only rank 0 raised, the others would wait at the next collective until the process group's timeout
(30 minutes by default). So rank 0 waits for every engine's answer, checks it, and broadcasts what went
wrong (or nothing); then every rank raises the same `EngineSyncError`, or none does.
"""

from __future__ import annotations

from typing import Callable

import ray
import torch
import torch.distributed as dist


class EngineSyncError(RuntimeError):
    """An engine did not take the weights sent to it (the message names the engine and why)."""


def send_to_engines(engines: list, method: str, state: dict[str, torch.Tensor] | None,
                    check: Callable[[object], str | None],
                    refuse: Callable[[dict[str, torch.Tensor]], str | None] = lambda state: None) -> None:
    """On rank 0 (`state` given): unless `refuse(state)` names a problem, `engine.<method>(blob)` on every
    engine and `check(answer)` on each answer (a problem, or None). On every rank: an `EngineSyncError` if
    anything went wrong (module docstring)."""
    problem = None
    if state is not None:
        problem = refuse(state) or _send(engines, method, state, check)
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise EngineSyncError(box[0])


def _send(engines: list, method: str, state: dict[str, torch.Tensor], check) -> str | None:
    from vllm_patches.transport import dump_blob

    blob = ray.put(dump_blob(state))
    refs = [getattr(engine, method).remote(blob) for engine in engines]
    problems = []
    for index, ref in enumerate(refs):  # every answer: no engine is still loading when the ranks raise
        try:
            answer = ray.get(ref)
        except Exception as err:  # RayTaskError (the engine raised; .cause is its error) or the actor died
            cause = getattr(err, "cause", None) or err
            first_line = (str(cause).strip().splitlines() or [""])[0][:300]
            problems.append(f"engine {index}: {type(cause).__name__}: {first_line}")
            continue
        if (problem := check(answer)) is not None:
            problems.append(f"engine {index}: {problem}")
    if not problems:
        return None
    return (f"GrowMTP: {method} failed on {len(problems)} of {len(engines)} engine(s), which now hold different "
            "weights; the run stops here (resume from the last checkpoint): " + "; ".join(problems))


def nonfinite_head(state: dict[str, torch.Tensor]) -> str | None:
    """A head with an infinite or NaN value is never sent: the last guard before every engine would draft
    with it (the optimizer already skips a step whose loss or gradient is not finite)."""
    bad = [name for name, tensor in state.items() if not bool(torch.isfinite(tensor).all())]
    return f"GrowMTP: the trained head holds non-finite values in {bad}; not sent to the engines" if bad else None


def loaded_all(sent: dict[str, torch.Tensor]) -> Callable[[list[list[str]]], str | None]:
    """The check of a head load's answer (the names every rank of an engine loaded): all of `sent`, on every rank."""
    expected = sorted(sent)

    def check(ranks: list[list[str]]) -> str | None:
        wrong = [rank for rank, names in enumerate(ranks) if sorted(names) != expected]
        if not ranks or wrong:
            return (f"rank(s) {wrong or 'none'} did not load exactly the {len(expected)} head tensors sent "
                    f"(first sent: {expected[:3]})")
        return None

    return check

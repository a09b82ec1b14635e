"""An autoregressive engine in a process of its own, for the paired measurement's `baseline="default"`.

A GrowMTP engine sets `VLLM_USE_V2_MODEL_RUNNER=0` in its process (its capture hooks wrap the V1 runner), and
vLLM reads that variable whenever it builds an engine: a plain engine built in the same process gets the V1
runner too, whatever vLLM's defaults are. `EngineProcess` builds the plain engine in a spawned process whose
environment lacks the variables named in `unset` (the runner choice), so that vLLM picks its own defaults
there; the parent sends each generate's prompts and sampling settings through a pipe and gets the number of
generated tokens back. The parent times each generate from outside, as it times the speculative arm; the
pipe adds a few kilobytes of prompt ids each way.

    with EngineProcess(functools.partial(PlainEngine, model, kwargs)) as ar:
        ar.facts                       # {"runner": ..., "async_scheduling": ..., "max_num_seqs": ..., "pid": ...}
        ar.generate_tokens(inputs, {"temperature": 1.0, "max_tokens": 64})
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
from typing import Callable

RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"  # vllm_patches.settings.RUNNER_ENV (not imported: it imports vLLM)


class PlainEngine:
    """A plain vLLM `LLM(model, **kwargs)` (built where it is constructed): generates, reports its settings."""

    def __init__(self, model: str, kwargs: dict):
        from vllm import LLM

        self.llm = LLM(model=model, **kwargs)

    def facts(self) -> dict:
        from vllm_patches.engine_facts import engine_facts

        return engine_facts(self.llm)

    def generate_tokens(self, inputs: list[dict], sampling: dict) -> int:
        from vllm import SamplingParams

        outputs = self.llm.generate(inputs, SamplingParams(**sampling), use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    def close(self) -> None:
        from vllm_patches.engine_facts import close_llm

        close_llm(self.llm)


def _serve(conn, build: Callable[[], object], unset: tuple[str, ...]) -> None:
    """The child: the environment cleaned before anything imports vLLM, the engine built, then one generate per
    message until None. Every failure goes back to the parent as text."""
    for name in unset:
        os.environ.pop(name, None)
    try:
        engine = build()
        conn.send(("ready", {**engine.facts(), "pid": os.getpid()}))
    except BaseException as err:  # noqa: BLE001 -- reported to the parent, which raises it
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    try:
        while (message := conn.recv()) is not None:
            try:
                conn.send(("ok", engine.generate_tokens(*message)))
            except Exception as err:  # noqa: BLE001
                conn.send(("error", f"{type(err).__name__}: {err}"))
    finally:
        engine.close()


class EngineProcess:
    """An engine built by `build()` (picklable: a module-level class or a functools.partial of one) in a
    spawned process without the environment variables `unset`."""

    def __init__(self, build: Callable[[], object], unset: tuple[str, ...] = (RUNNER_ENV,), timeout_s: float = 900):
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        # not daemonic: vLLM's engine core is a process of the engine's own (VLLM_ENABLE_V1_MULTIPROCESSING's
        # default), which a daemonic process may not start; `close` (and the pipe's end) stop it
        self._process = context.Process(target=_serve, args=(child, build, tuple(unset)))
        self._process.start()
        atexit.register(self.close)  # before multiprocessing's own exit handler joins it (atexit runs last-in first)
        child.close()
        self.timeout_s = timeout_s
        self.facts = self._receive("building the engine")

    def _receive(self, doing: str):
        if not self._conn.poll(self.timeout_s):
            self.close()
            raise TimeoutError(f"the engine process gave no answer within {self.timeout_s:.0f} s ({doing})")
        try:
            status, value = self._conn.recv()
        except EOFError:
            self.close()
            raise RuntimeError(f"the engine process ended while {doing} (exit code {self._process.exitcode})")
        if status == "error":
            self.close()
            raise RuntimeError(f"the engine process failed while {doing}: {value}")
        return value

    def generate_tokens(self, inputs: list[dict], sampling: dict) -> int:
        self._conn.send((inputs, sampling))
        return self._receive("generating")

    def close(self) -> None:
        atexit.unregister(self.close)
        if self._process.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._process.join(60)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

"""A stand-in for `measure.engine_process.PlainEngine` without vLLM, for the engine-process tests: it reports
its process and the runner choice it sees in its environment, and generates `max_tokens` per prompt. With
`with_child` it starts a process of its own, as vLLM's engine core does by default
(`VLLM_ENABLE_V1_MULTIPROCESSING=1`)."""

from __future__ import annotations

import multiprocessing
import os
import time


class FakePlainEngine:
    def __init__(self, fail_on: str | None = None, with_child: bool = False):
        self.fail_on, self.child = fail_on, None
        if fail_on == "build":
            raise ValueError("no such model")
        if with_child:
            self.child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
            self.child.start()

    def facts(self) -> dict:
        return {"runner": "fake", "VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
                "child_pid": self.child.pid if self.child else None}

    def generate_tokens(self, inputs: list[dict], sampling: dict) -> int:
        if self.fail_on == "generate":
            raise RuntimeError("out of memory")
        return len(inputs) * sampling["max_tokens"]

    def close(self) -> None:
        if self.child is not None:
            self.child.kill()
            self.child.join()

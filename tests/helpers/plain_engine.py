"""A stand-in for `measure.engine_process.PlainEngine` without vLLM, for the engine-process tests: it reports
its process and the runner choice it sees in its environment, and generates `max_tokens` per prompt."""

from __future__ import annotations

import os


class FakePlainEngine:
    def __init__(self, fail_on: str | None = None):
        self.fail_on = fail_on
        if fail_on == "build":
            raise ValueError("no such model")

    def facts(self) -> dict:
        return {"runner": "fake", "VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER")}

    def generate_tokens(self, inputs: list[dict], sampling: dict) -> int:
        if self.fail_on == "generate":
            raise RuntimeError("out of memory")
        return len(inputs) * sampling["max_tokens"]

    def close(self) -> None:
        pass

"""GROWMTP_SMOKE=1's verdict (`cli/smoke.py`): each check fails on the step that breaks it, and the list of the
paths no GPU has run marks what a command takes. The smoke itself on CPU: tests/examples/test_rehearsal.py."""

from __future__ import annotations

import json
import math

import pytest

from openrlhf_growmtp.cli import smoke


def row(step: int, **changed) -> dict:
    """A healthy step of a GrowMTP smoke run at K = 3."""
    good = {"step": step, "growmtp/records": 8.0, "growmtp/records_checked": 8.0, "growmtp/tau": 1.4,
            "growmtp/head_sync_max_diff": 0.0, "growmtp/head_sync_params": 12.0, "growmtp/head_loss": -0.2,
            "growmtp/head_finite": 1.0, "growmtp/rollout_s": 2.0, "timing/make_experience": 1.0,
            "timing/ppo_train": 3.0, "growmtp/head_update_s": 1.0, "timing/broadcast": 0.5, "growmtp/step_s": 6.5,
            "growmtp/mem_trainer_peak_gib": 30.0, "growmtp/mem_trainer_used_gib": 40.0,
            "growmtp/mem_engine_peak_gib": 60.0, "growmtp/mem_engine_used_gib": 64.0,
            "growmtp/mem_engine_total_gib": 80.0}
    return {**good, **changed}


def failed(rows, k=3, trains_head=True) -> list[str]:
    return [c.name for c in smoke.checks(rows, 3, k, trains_head) if not c.passed]


def test_a_healthy_run_passes_every_check():
    assert failed([row(1), row(2), row(3)]) == []
    assert len(smoke.checks([row(1), row(2), row(3)], 3, 3, True)) == 7


@pytest.mark.parametrize("broken, check", [
    ({"growmtp/records_checked": 7.0}, "records equal vLLM's own counters"),  # one record never compared
    ({"growmtp/records": 0.0, "growmtp/records_checked": 0.0}, "records equal vLLM's own counters"),  # no record
    ({"growmtp/head_sync_max_diff": 2e-3}, "the engines' head equals the trainer's after the sync"),
    ({"growmtp/head_sync_params": 0.0}, "the engines' head equals the trainer's after the sync"),  # nothing compared
    ({"growmtp/tau": math.nan}, "tau finite, within 1..K+1"),
    ({"growmtp/tau": 4.5}, "tau finite, within 1..K+1"),  # above K + 1 = 4: not a count of committed tokens
    ({"growmtp/head_loss": math.inf}, "head loss finite, the head update never skipped"),
    ({"growmtp/head_finite": 0.0}, "head loss finite, the head update never skipped"),
    ({"growmtp/mem_engine_used_gib": None}, "memory per device logged"),
    ({"timing/broadcast": None}, "seconds per phase logged"),
])
def test_each_check_fails_at_the_step_that_breaks_it(broken, check):
    rows = [row(1), row(2, **broken), row(3)]
    assert failed(rows) == [check]
    detail = next(c.detail for c in smoke.checks(rows, 3, 3, True) if c.name == check)
    assert "failed at steps [2]" in detail


def test_missing_steps_and_a_missing_log_fail():
    assert failed([row(1), row(3)]) == ["RL steps logged"]
    assert set(failed([])) >= {"RL steps logged", "records equal vLLM's own counters", "memory per device logged"}


def test_an_autoregressive_or_frozen_run_is_not_held_to_what_it_does_not_do():
    plain = [{k: v for k, v in row(i).items() if not k.startswith("growmtp/") or k.startswith("growmtp/mem")
              or k in ("growmtp/rollout_s", "growmtp/step_s")} for i in (1, 2, 3)]
    assert failed(plain, k=0, trains_head=True) == []
    frozen = [{k: v for k, v in row(i).items() if "head" not in k} for i in (1, 2, 3)]
    assert failed(frozen, k=3, trains_head=False) == []


def test_the_verdict_reads_the_runs_metrics_file_and_exits_1_on_a_failure(tmp_path, capsys):
    (tmp_path / smoke.METRICS_FILE).write_text("".join(json.dumps(row(i)) + "\n" for i in (1, 2, 3)))
    assert smoke.main(["verdict", str(tmp_path), "--steps", "3", "--k", "3"]) == 0
    out = capsys.readouterr().out
    assert "SMOKE PASSED: 7 of 7 checks" in out and "64.00  engine, device in use" in out and "80% of" in out
    (tmp_path / smoke.METRICS_FILE).write_text(json.dumps(row(1, **{"growmtp/head_sync_max_diff": 1.0})) + "\n")
    assert smoke.main(["verdict", str(tmp_path), "--steps", "1", "--k", "3"]) == 1
    assert "[FAIL] the engines' head equals" in capsys.readouterr().out


def test_the_untried_paths_are_marked_by_the_commands_flags():
    def taken(*argv, torch="2.13.0"):
        return {p.name.split(" (")[0]: p.taken for p in smoke.untried_paths(list(argv), torch_version=torch)}

    growmtp = taken("--growmtp_k", "5", "--vllm.num_engines", "4")
    assert growmtp == {"vLLM's V1 model runner, forced": True, "synchronous scheduling": True,
                       "the policy's NCCL weight sync with the head hidden from it": True,
                       "CUDA graphs with record capture": True, "tensor-parallel engines over Ray": False,
                       "vLLM's sleep mode": False, "flash_attention_2 in the trainer": True,
                       "DeepSpeed's FusedAdam with the head's parameter group": True, "torch 2.13 on CUDA": True,
                       "more than one node": False, "the production trainer step with the head": True}
    fallbacks = taken("--growmtp_k", "5", "--vllm.sync_backend", "ray", "--vllm.enforce_eager",
                      "--vllm.tensor_parallel_size", "2", "--vllm.enable_sleep", "--ds.attn_implementation", "sdpa",
                      "--ds.adam_offload", "--train.full_determinism_enable", "--actor.num_nodes", "2")
    assert not fallbacks["the policy's NCCL weight sync with the head hidden from it"]
    assert not fallbacks["CUDA graphs with record capture"] and fallbacks["tensor-parallel engines over Ray"]
    assert not fallbacks["flash_attention_2 in the trainer"]
    assert not fallbacks["DeepSpeed's FusedAdam with the head's parameter group"]
    assert not fallbacks["the production trainer step with the head"] and fallbacks["more than one node"]
    # packing brings flash_attention_2 back (upstream sets it); another torch is not the untried one
    assert taken("--growmtp_k", "5", "--ds.attn_implementation", "sdpa", "--ds.packing_samples")[
        "flash_attention_2 in the trainer"]
    assert not taken("--growmtp_k", "5", torch="2.11.0")["torch 2.13 on CUDA"]
    frozen = taken("--growmtp_k", "1", "--growmtp_mode", "frozen")  # drafts, never trains: no head step at all
    assert not frozen["DeepSpeed's FusedAdam with the head's parameter group"]
    assert not frozen["the production trainer step with the head"] and frozen["CUDA graphs with record capture"]
    autoregressive = taken("--growmtp_k", "0")  # the autoregressive arm on vLLM's defaults
    assert {name for name, on in autoregressive.items() if on} == {"flash_attention_2 in the trainer",
                                                                   "torch 2.13 on CUDA"}
    matched = taken("--growmtp_k", "0", "--vllm.runner", "growmtp")
    assert matched["vLLM's V1 model runner, forced"] and not matched["CUDA graphs with record capture"]
    assert all(p.fallback and p.cost for p in smoke.untried_paths([]))


def test_the_guide_lists_every_untried_path_with_its_fallback():
    """docs/guide.md's table of paths never run on a GPU is the smoke's list (step 4 of the first run)."""
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[2] / "docs" / "guide.md").read_text(encoding="utf-8")
    table = guide.split("| never run on a GPU |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("|")[1].strip() for line in table.splitlines()[2:]]
    assert rows == [p.name.split(" (")[0] for p in smoke.untried_paths([])]

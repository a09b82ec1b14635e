"""`make serve` / `make serve-check` without a server: which run is served, and the acceptance read from
vLLM's /metrics page (Prometheus text as vLLM 0.29's server writes it)."""

import math
import os

import pytest

from openrlhf_growmtp.cli.serve import ARM, FINAL, newest_run
from openrlhf_growmtp.cli.serve_check import acceptance, spec_decode_counters
from openrlhf_growmtp.core.model_export import ExportError


def page(drafts, tokens, accepted, per_position, model="growmtp"):
    labels = f'engine="0",model_name="{model}"'
    lines = ["# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.",
             "# TYPE vllm:spec_decode_num_drafts counter",
             f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts}",
             f"vllm:spec_decode_num_drafts_created{{{labels}}} 1.7955971043e+09",
             f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {tokens}",
             f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {accepted}",
             "vllm:prompt_tokens_total{" + labels + "} 123.0"]
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{p}"}} {n}'
              for p, n in reversed(list(enumerate(per_position)))]  # any order on the page
    return "\n".join(lines) + "\n"


def test_a_taken_port_is_refused_before_anything_is_exported(tmp_path, capsys):
    """A server already on the port (a `make serve` left running) would answer /health for the one started, and
    serve-check would measure it instead: refused by name, before the export."""
    import socket

    from openrlhf_growmtp.cli import serve

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(serve.PortInUseError, match=f"127.0.0.1:{port} is taken"):
            serve.check_port_free("127.0.0.1", port)
        assert serve.main(["--export", str(tmp_path / "none"), "--port", str(port)]) == 2
        assert f"127.0.0.1:{port} is taken" in capsys.readouterr().err
    serve.check_port_free("127.0.0.1", port)  # closed: free again


def test_acceptance_from_two_metrics_pages():
    before = spec_decode_counters(page(0.0, 0.0, 0.0, [0.0, 0.0, 0.0]))
    # the counters after six requests to `make serve` (README, "Serve what the run grew")
    after = spec_decode_counters(page(103.0, 309.0, 36.0, [27.0, 8.0, 1.0]))
    assert after == {"drafts": 103.0, "draft_tokens": 309.0, "accepted_tokens": 36.0,
                     "accepted_per_position": [27.0, 8.0, 1.0]}
    result = acceptance(before, after)
    assert result["tau"] == pytest.approx(1 + 36 / 103)
    assert result["alpha"] == pytest.approx([27 / 103, 8 / 103, 1 / 103])
    assert result["tau"] == pytest.approx(1 + sum(result["alpha"]))  # τ = 1 + Σ α_k
    # the drafts' accepted counts, from the per-position totals: 76 drafts accepted 0, 19 accepted 1, 7 accepted 2,
    # 1 accepted 3; the standard error of their mean, from that list directly
    counts = [0] * 76 + [1] * 19 + [2] * 7 + [3] * 1
    mean = sum(counts) / len(counts)
    variance = sum((c - mean) ** 2 for c in counts) / len(counts)
    assert result["tau_standard_error"] == pytest.approx(math.sqrt(variance / len(counts)), rel=1e-12)
    assert acceptance(after, after)["drafts"] == 0  # nothing drafted in between: no τ to report


def test_the_newest_demo_run_is_served_and_none_is_a_clear_error(tmp_path):
    with pytest.raises(ExportError, match="make demo-quick"):
        newest_run(tmp_path)
    for name, mtime in (("demo", 1_000), ("demo-quick", 2_000)):
        (tmp_path / name / ARM / FINAL).mkdir(parents=True)
        os.utime(tmp_path / name / ARM / FINAL, (mtime, mtime))
    (tmp_path / "demo-other" / ARM / FINAL).mkdir(parents=True)  # not a `make demo` run
    assert newest_run(tmp_path) == tmp_path / "demo-quick"
    os.utime(tmp_path / "demo" / ARM / FINAL, (3_000, 3_000))
    assert newest_run(tmp_path) == tmp_path / "demo"

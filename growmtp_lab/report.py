"""The demo's per-step metrics (read from each arm's TensorBoard log), summary, table and plots.

Both arms are measured by the same clocks: upstream's own `timing/generation` (the rollout) and
`timing/step_total` (rollout + experience + training + weight sync), logged by upstream's TensorBoard
logger; the GrowMTP arm adds its `growmtp/*` metrics to the same log.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean

from openrlhf_growmtp.measure.intervals import BATCH, batch_ratio_interval, verdict, verdict_phrase

FINAL_WINDOW = 5  # "final" values are means over the last steps (one step's τ or reward is noisy)...
SPEEDUP_WINDOW = 10  # the speedups are means over the last steps too (rollout_speedup_last10, ...)


def final_window(steps: int) -> int:
    """...over at most the last quarter of the run, so that a short run's "final" is not its start."""
    return max(1, min(FINAL_WINDOW, steps // 4))


TAGS = {  # row field -> TensorBoard tag written by upstream's TensorboardLogger (train/<status key>)
    "reward": "train/reward",
    "rollout_s": "train/timing/generation",
    "step_s": "train/timing/step_total",
    "response_length": "train/response_length",
    "tau": "train/growmtp/tau",
    "depth": "train/growmtp/depth",
    "cycles": "train/growmtp/cycles",
    "head_loss": "train/growmtp/head_loss",
    "head_update_s": "train/growmtp/head_update_s",
    "head_topk_mass": "train/growmtp/head_topk_mass",
    "draft_vocab_coverage": "train/growmtp/draft_vocab_coverage",  # --growmtp_draft_vocab only
}
POSITIONAL = ("alpha", "head_alpha", "lag_alpha")  # train/growmtp/<name>_<k>, k = 1..K


def read_arm(tensorboard_dir: str | Path, arm: str, k: int) -> list[dict]:
    """One row per step: {"arm", "step", reward, rollout_s, step_s, ... , "alpha": [α_1..α_K] (K > 0)}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(Path(tensorboard_dir).rglob("events.out.tfevents.*"))
    if not files:
        raise FileNotFoundError(f"no TensorBoard events under {tensorboard_dir}")
    events = EventAccumulator(str(files[-1].parent), size_guidance={"scalars": 0})
    events.Reload()
    available = set(events.Tags()["scalars"])
    series = {field: {e.step: e.value for e in events.Scalars(tag)} for field, tag in TAGS.items() if tag in available}
    # per-position series: the engine's alpha_k, and where logged the trainer's head_alpha_k and lag_alpha_k
    # a position no step drafted (an auto run that stayed shallower) has no tag at all
    positional = {name: [{e.step: e.value for e in events.Scalars(tag)} if (tag := f"train/growmtp/{name}_{i}")
                         in available else {} for i in range(1, k + 1)]
                  for name in POSITIONAL if k and f"train/growmtp/{name}_1" in available}
    rows = []
    for step in sorted(series["reward"]):
        row = {"arm": arm, "step": step, **{field: values[step] for field, values in series.items() if step in values}}
        for name, per_position in positional.items():  # None beyond the depth a step drafted at (auto)
            if any(step in values for values in per_position):
                row[name] = [values.get(step) for values in per_position]
        rows.append(row)
    return rows


ENGINE_FACTS_LINE = "growmtp engine facts: "  # vllm_patches.engine_facts.ENGINE_FACTS_LINE (not imported: vLLM)


def engine_facts(train_log: str | Path) -> list[dict]:
    """Each rollout engine's runner, scheduling and max_num_seqs, as its actor logged them in the run's log."""
    found = []
    for line in Path(train_log).read_text(errors="replace").splitlines():
        if ENGINE_FACTS_LINE in line:
            found.append(json.loads(line.split(ENGINE_FACTS_LINE, 1)[1]))
    return found


def _mean_known(values) -> float | None:
    """The mean of the values that were logged (None: a step that drafted less deep)."""
    known = [v for v in values if v is not None]
    return mean(known) if known else None


def _final(rows: list[dict], field: str) -> float:
    return mean(row[field] for row in rows[-final_window(len(rows)):])


def _ratio(numerator: list[dict], denominator: list[dict], field: str, skip_first: bool) -> float:
    start = 1 if skip_first and min(len(numerator), len(denominator)) > 1 else 0
    return mean(r[field] for r in numerator[start:]) / mean(r[field] for r in denominator[start:])


def speedup_last(ar: list[dict], growmtp: list[dict], field: str, window: int = SPEEDUP_WINDOW) -> float:
    """Autoregressive time / GrowMTP time, each the mean of `field` over the last `window` steps."""
    return mean(r[field] for r in ar[-window:]) / mean(r[field] for r in growmtp[-window:])


def crossover_step(growmtp: list[dict], ar: list[dict], field: str = "step_s") -> int | None:
    """The step from which GrowMTP's cumulative `field` (its RL steps' wall so far) is below the autoregressive
    arm's and stays below at every later step; None where it is not below at the last step. E.g. GrowMTP / AR
    step times 1.3, 0.6, 1.1, 0.9, 0.8 of AR's 10 s: cumulative 13/10, 19/20, 30/30, 39/40, 47/50 -> step 4 (a tie
    at step 3 is not below)."""
    theirs = {row["step"]: row[field] for row in ar}
    mine_total = ar_total = 0.0
    crossed = None
    for row in growmtp:
        if row["step"] not in theirs:
            break
        mine_total += row[field]
        ar_total += theirs[row["step"]]
        if mine_total >= ar_total:
            crossed = None
        elif crossed is None:
            crossed = row["step"]
    return crossed


def cumulative(rows: list[dict], ar_rows: list[dict]) -> dict:
    """The RL steps' cumulative wall, GrowMTP / autoregressive, at every step, and at the end with its
    batch-means interval over the steps: what the noise of single steps leaves of the end ratio."""
    theirs = {r["step"]: r["step_s"] for r in ar_rows}
    common = [r for r in rows if r["step"] in theirs]
    mine, ar = [r["step_s"] for r in common], [theirs[r["step"]] for r in common]
    ratios, total, ar_total = [], 0.0, 0.0
    for a, b in zip(mine, ar):
        total, ar_total = total + a, ar_total + b
        ratios.append(total / ar_total)
    return {"steps": [r["step"] for r in common], "ratio": ratios,
            "end": batch_ratio_interval(mine, ar).as_dict() if len(common) >= 3 * BATCH else None,
            "crossover_step": crossover_step(rows, ar_rows)}


def tokens_per_step(rows: list[dict], samples_per_step: int) -> list[float]:
    """Generated tokens of each step's rollout: upstream's mean `response_length` times the step's samples."""
    return [row["response_length"] * samples_per_step for row in rows]


def summarize(growmtp: list[dict], ar: list[dict], k: int, extra: dict) -> dict:
    """summary.json. Time ratios are GrowMTP / autoregressive, mean per step, first step excluded (it holds
    each engine's one-off warm-up); the all-steps ratios are kept next to them. Speedups are the other way
    round (autoregressive / GrowMTP) over the last `SPEEDUP_WINDOW` steps; `crossover_step` is the first step
    from which every GrowMTP step is faster than the autoregressive one."""
    return {
        "k": k,
        "steps": len(growmtp),
        "tau_first": growmtp[0]["tau"],
        "tau_final": _final(growmtp, "tau"),
        "tau_max": max(row["tau"] for row in growmtp),
        "alpha_first": growmtp[0]["alpha"],
        "alpha_final": [_mean_known(row["alpha"][i] for row in growmtp[-final_window(len(growmtp)):])
                        for i in range(k)],
        "reward_first_growmtp": growmtp[0]["reward"],
        "reward_first_ar": ar[0]["reward"],
        "reward_final_growmtp": _final(growmtp, "reward"),
        "reward_final_ar": _final(ar, "reward"),
        "reward_mean_growmtp": mean(row["reward"] for row in growmtp),
        "reward_mean_ar": mean(row["reward"] for row in ar),
        "rollout_time_ratio": _ratio(growmtp, ar, "rollout_s", skip_first=True),
        "step_time_ratio": _ratio(growmtp, ar, "step_s", skip_first=True),
        "rollout_speedup_last10": speedup_last(ar, growmtp, "rollout_s"),
        "step_speedup_last10": speedup_last(ar, growmtp, "step_s"),
        "crossover_step": crossover_step(growmtp, ar),
        "rollout_time_ratio_all_steps": _ratio(growmtp, ar, "rollout_s", skip_first=False),
        "step_time_ratio_all_steps": _ratio(growmtp, ar, "step_s", skip_first=False),
        "rollout_s_mean_growmtp": mean(row["rollout_s"] for row in growmtp[1:] or growmtp),
        "rollout_s_mean_ar": mean(row["rollout_s"] for row in ar[1:] or ar),
        "head_update_s_mean": mean(row["head_update_s"] for row in growmtp),
        "final_window": final_window(len(growmtp)),
        **extra,
    }


def _interval(figure: dict) -> str:
    return f"{figure['estimate']:.2f}x [{figure['low']:.2f}, {figure['high']:.2f}]"


def _spread(measured: dict) -> str:
    """How a paired figure was made and the processes' own figures (the between-process spread)."""
    if "speedup_per_process" not in measured:
        return f"median of {measured['pairs']} pairs, one process"
    return (f"mean of {measured['processes']} processes' medians, t 95% over processes; the processes "
            + ", ".join(f"{v:.2f}" for v in measured["speedup_per_process"]))


def summary_lines(summary: dict, k: int, wall: dict[str, float]) -> list[str]:
    """The demo's printed summary: the paired figures first, then the run's own (unpaired) ones, named as such."""
    lines = []
    paired = summary.get("paired") or []
    if paired:
        last = paired[-1]
        lines.append(f"paired rollout speedup after step {last['step']} (τ {last['tau']:.2f}, depth {last['depth']}, "
                     f"{last['requests']} requests, same engine settings): {_interval(last['speedup'])} per generated "
                     f"token ({_spread(last)}): {verdict_phrase(last['speedup'])}")
        for earlier in paired[:-1]:
            lines.append(f"  after step {earlier['step']} (τ {earlier['tau']:.2f}): {_interval(earlier['speedup'])} "
                         f"({_spread(earlier)}): {verdict_phrase(earlier['speedup'])}")
    regimes = summary.get("regimes")
    if regimes:
        s, best = regimes["speedup"], regimes["best"]
        judged = verdict(s)
        winner = {"above": "speculative decoding wins", "below": "autoregressive decoding wins",
                  "tie": "a tie"}.get(judged, judged)
        lines.append(f"each at its best concurrency on this machine (autoregressive {best['ar']}, speculative "
                     f"{best['spec']} requests at a time): speculative {_interval(s)} per generated token "
                     f"({_spread(regimes)}): {winner}")
    lines.append(f"τ {summary['tau_first']:.2f} -> {summary['tau_final']:.2f} (mean of the last "
                 f"{summary['final_window']} steps; max {summary['tau_max']:.2f}; K+1 = {k + 1}); α_final = "
                 f"[{' '.join(f'{a:.2f}' if a is not None else '-' for a in summary['alpha_final'])}]")
    lines.append(f"reward: GrowMTP {summary['reward_first_growmtp']:.2f} -> {summary['reward_final_growmtp']:.2f}, "
                 f"autoregressive {summary['reward_first_ar']:.2f} -> {summary['reward_final_ar']:.2f} (one run each)")
    crossed = summary["crossover_step"]
    lines.append(f"whole run (one run per arm, unpaired): GrowMTP's arm {summary['net_wall_ratio']:.2f}x the "
                 f"autoregressive arm's wall ({wall['growmtp']:.0f} s against {wall['ar']:.0f} s, head training "
                 f"included); its cumulative step time "
                 + (f"below the autoregressive arm's from step {crossed} on" if crossed is not None
                    else "not below the autoregressive arm's at the end"))
    window = min(SPEEDUP_WINDOW, summary["steps"])
    lines.append(f"the arms' own steps (different responses): rollout speedup "
                 f"{summary['rollout_speedup_last10']:.2f}x, step {summary['step_speedup_last10']:.2f}x over the "
                 f"last {window} steps; GrowMTP / "
                 f"autoregressive per step after the first: rollout {summary['rollout_time_ratio']:.2f}x, step "
                 f"{summary['step_time_ratio']:.2f}x")
    return lines


def table(growmtp: list[dict], ar: list[dict], k: int) -> str:
    """The per-step table, both arms side by side."""
    alpha_heads = "".join(f"{f'α{i}':>6}" for i in range(1, k + 1))
    depth = any("depth" in row for row in growmtp)  # --growmtp_depth auto: the depth of each step
    width = 7 + 6 * k + 25 + (6 if depth else 0)
    lines = [f"{'':5}{'GrowMTP K=' + str(k):<{width}}| autoregressive",
             f"{'step':>5}{'depth' if depth else '':>{6 if depth else 0}}{'τ':>7}{alpha_heads}{'reward':>8}"
             f"{'roll s':>8}{'head s':>8}{'step s':>8} |{'reward':>8}{'roll s':>8}{'step s':>8}"]
    by_step = {row["step"]: row for row in ar}
    for row in growmtp:
        other = by_step.get(row["step"])
        alphas = "".join(f"{a:6.2f}" if a is not None else f"{'-':>6}" for a in row.get("alpha", [None] * k))
        right = (f"{other['reward']:8.3f}{other['rollout_s']:8.2f}{other['step_s']:8.2f}" if other else "")
        chosen = f"{int(row['depth']):6d}" if depth else ""
        lines.append(f"{row['step']:5d}{chosen}{row['tau']:7.3f}{alphas}{row['reward']:8.3f}{row['rollout_s']:8.2f}"
                     f"{row['head_update_s']:8.2f}{row['step_s']:8.2f} |{right}")
    return "\n".join(lines)


def write_metrics(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def plot(out_dir: Path, growmtp: list[dict], ar: list[dict], k: int) -> list[Path]:
    """tau.png, alpha.png, time.png, reward.png and overview.png (the four panels in one figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["step"] for row in growmtp]
    ar_steps = [row["step"] for row in ar]

    def tau(ax):
        ax.plot(steps, [row["tau"] for row in growmtp], marker=".", color="C0", label="GrowMTP")
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.axhline(k + 1.0, color="grey", lw=0.8, ls="--", label=f"K+1 = {k + 1}")
        ax.set(title="τ: tokens per target forward (from a random head)", xlabel="RL step", ylabel="τ")
        ax.legend(loc="lower right")

    def alpha(ax):
        for i in range(k):
            known = [(row["step"], row["alpha"][i]) for row in growmtp
                     if row.get("alpha") and row["alpha"][i] is not None]
            ax.plot([s for s, _ in known], [a for _, a in known], marker=".", label=f"α{i + 1}")
        ax.set(title="per-position acceptance α_k = P(accepted ≥ k)", xlabel="RL step", ylabel="α", ylim=(0, 1))
        ax.legend(loc="upper left")

    def times(ax):
        ax.plot(steps, [row["rollout_s"] for row in growmtp], color="C0", label="GrowMTP rollout")
        ax.plot(ar_steps, [row["rollout_s"] for row in ar], color="C1", label="autoregressive rollout")
        ax.plot(steps, [row["step_s"] for row in growmtp], color="C0", ls="--", label="GrowMTP step")
        ax.plot(ar_steps, [row["step_s"] for row in ar], color="C1", ls="--", label="autoregressive step")
        crossed = crossover_step(growmtp, ar)
        if crossed is not None:
            ax.axvline(crossed, color="grey", lw=0.8, ls=":", label=f"GrowMTP faster from step {crossed}")
        if any("depth" in row for row in growmtp):  # --growmtp_depth auto: the depth each rollout drafted at
            depth_ax = ax.twinx()
            depth_ax.step(steps, [row.get("depth", k) for row in growmtp], where="mid", color="grey", lw=0.8,
                          label="depth drafted")
            depth_ax.set(ylabel="depth drafted", ylim=(-0.2, k + 0.5))
            depth_ax.legend(loc="lower right", fontsize="small")
        ax.set(title="wall time per RL step (first step: engine warm-up)", xlabel="RL step", ylabel="seconds",
               yscale="log")
        ax.legend(loc="upper right", fontsize="small")

    def reward(ax):
        ax.plot(steps, [row["reward"] for row in growmtp], color="C0", label="GrowMTP")
        ax.plot(ar_steps, [row["reward"] for row in ar], color="C1", label="autoregressive")
        ax.set(title="reward (answer correct)", xlabel="RL step", ylabel="mean reward", ylim=(0, 1.02))
        ax.legend(loc="lower right")

    written = []
    for name, draw in (("tau", tau), ("alpha", alpha), ("time", times), ("reward", reward)):
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax)
        fig.tight_layout()
        written.append(out_dir / f"{name}.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, draw in zip(axes.flat, (tau, alpha, times, reward)):
        draw(ax)
    fig.tight_layout()
    written.append(out_dir / "overview.png")
    fig.savefig(written[-1], dpi=90)
    plt.close(fig)
    return written


def interval_comparison(earlier_step: Path, repeated: list[Path], current_step: Path, step: int) -> dict:
    """The intervals of one checkpoint's paired figure side by side (docs/demo.md): the earlier demo's kept
    figure (one process, 6 pairs, the percentile bootstrap it was made with) and the same pairs' order-statistic
    interval; the speed study's two bit-identical runs of one seed at `step` (each one process, and the two taken
    as two processes); and `current_step`'s figure over its processes."""
    from openrlhf_growmtp.measure.intervals import median_interval, process_interval

    earlier = json.loads(Path(earlier_step).read_text())
    runs = [next(p for p in json.loads(Path(path).read_text())["paired"] if p["step"] == step) for path in repeated]
    two, medians = process_interval([run["speedup_per_pair"] for run in runs])
    current = json.loads(Path(current_step).read_text())
    return {
        "earlier_bootstrap": earlier["speedup"],
        "earlier_order_statistic": median_interval(earlier["speedup_per_pair"]).as_dict(),
        "repeated_runs_bootstrap": [run["speedup"] for run in runs],
        "repeated_runs_order_statistic": [median_interval(run["speedup_per_pair"]).as_dict() for run in runs],
        "repeated_runs_as_processes": {**two.as_dict(), "per_process": medians},
        "current": {**current["speedup"], "per_process": current.get("speedup_per_process")},
        "sources": {"earlier": str(earlier_step), "repeated": [str(p) for p in repeated], "current": str(current_step)},
    }

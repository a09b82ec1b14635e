"""The ablation arms of `make ablations`, their per-seed summaries, the comparison across seeds, and the plots.

Every arm is a world's GRPO run (same world, data, seed and settings, `growmtp_lab.recipes`) with the flags
below; the autoregressive arm is upstream's run (`--growmtp_k 0`). An ordering between two arms is claimed
only where their seeds do not overlap: every seed of one is above every seed of the other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

from growmtp_lab.report import final_window


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    flags: tuple[str, ...] = ()
    drafts: bool = True  # False: the autoregressive arm (--growmtp_k 0)
    paper: bool = True  # one of the paper's arms (run by default); False: an upstream configuration to compare
    one_policy_step: bool = False  # one policy optimizer step per RL step instead of the world's layout


ARMS = {arm.name: arm for arm in (
    Arm("growmtp", "GrowMTP (DCA + VGM)", ("--growmtp_log_lag",)),
    Arm("ce", "CE", ("--growmtp_loss", "ce")),
    Arm("kl", "KL", ("--growmtp_loss", "kl")),
    Arm("tv", "TV", ("--growmtp_loss", "tv")),
    Arm("dca_no_vgm", "DCA without VGM", ("--growmtp_no_vgm",)),
    Arm("teacher_forcing", "teacher forcing", ("--growmtp_teacher_forcing",)),
    # joint mode needs one policy step per RL step (the head's loss is part of that step's policy loss)
    Arm("joint", "joint (head loss reaches the policy)", ("--growmtp_mode", "joint"), one_policy_step=True),
    Arm("frozen", "frozen random head", ("--growmtp_mode", "frozen")),
    Arm("ar", "autoregressive", drafts=False),
    # rollouts one policy step behind the trainer (the head trains on the trainer's hidden states)
    Arm("async", "GrowMTP, async training", ("--train.async_enable",), paper=False),
    # the cold-start objective (docs/from_scratch.md)
    Arm("hybrid", "hybrid (λ CE + (1 − λ) DCA)", ("--growmtp_loss", "hybrid"), paper=False),
)}
PAPER_ARMS = tuple(name for name, arm in ARMS.items() if arm.paper)
REFERENCE = "growmtp"


def seed_summary(rows: list[dict], warmup_steps: int) -> dict:
    """One arm, one seed: the fields of docs/data/ablations/ablations.json (τ and α only where the arm drafts)."""
    window = rows[-final_window(len(rows)):]
    later = rows[1:] or rows  # the first step holds the engines' one-off warm-up
    out = {"steps": len(rows), "reward_mean": mean(r["reward"] for r in rows),
           "reward_final": mean(r["reward"] for r in window),
           "rollout_s": mean(r["rollout_s"] for r in later), "step_s": mean(r["step_s"] for r in later)}
    if "tau" in rows[0]:
        k = len(rows[0]["alpha"])
        out.update(tau_first=rows[0]["tau"], tau_final=mean(r["tau"] for r in window),
                   tau_max=max(r["tau"] for r in rows),
                   alpha_final=[mean(r["alpha"][i] for r in window) for i in range(k)])
    if "head_alpha" in rows[0] and "alpha" in rows[0]:
        # the update's α at the first draft position minus the rollout's realised one (docs/from_scratch.md)
        out["alpha_gap_final"] = mean(r["head_alpha"][0] - r["alpha"][0] for r in window)
    if "head_update_s" in rows[0]:
        out["head_update_s"] = mean(r["head_update_s"] for r in rows)
    if "lag_alpha" in rows[0]:
        out["lag"] = lag(rows, warmup_steps)
    return out


def lag(rows: list[dict], warmup_steps: int) -> dict:
    """The one-step lag, per draft position k, from a run logged with --growmtp_log_lag.

    After step t's head update, `lag_alpha_k(t)` is the new head's α on step t's records (the policy it
    was trained for); `head_alpha_k(t+1)` is the same head's α on step t+1's records (the next policy,
    which it drafts for). Both are the trainer's α over the cycles that reach position k, from the same
    records' top-k log-probs. The lag is their difference, averaged over the steps after the head's LR
    warm-up; `relative` divides by the mean of lag_alpha.
    """
    by_step = {r["step"]: r for r in rows}
    pairs = [(r["lag_alpha"], by_step[r["step"] + 1]["head_alpha"]) for r in rows
             if r["step"] > warmup_steps and "lag_alpha" in r and "head_alpha" in by_step.get(r["step"] + 1, {})]
    if not pairs:
        return {"steps": 0}
    k = len(pairs[0][0])
    trained = [mean(p[0][i] for p in pairs) for i in range(k)]
    nxt = [mean(p[1][i] for p in pairs) for i in range(k)]
    return {"steps": len(pairs), "alpha_trained_policy": trained, "alpha_next_policy": nxt,
            "gap": [a - b for a, b in zip(trained, nxt)],
            "relative": [(a - b) / a if a > 0 else 0.0 for a, b in zip(trained, nxt)]}


def compare(per_seed: dict[str, dict[int, dict]]) -> dict:
    """Per arm: the mean and range over seeds of every scalar; per drafting arm vs GrowMTP: whether τ_final
    is separated (every seed of one above every seed of the other) and which way."""
    out = {}
    for arm, seeds in per_seed.items():
        rows = list(seeds.values())
        scalars = [key for key, value in rows[0].items() if isinstance(value, (int, float))]
        out[arm] = {key: {"mean": mean(r[key] for r in rows), "min": min(r[key] for r in rows),
                          "max": max(r[key] for r in rows)} for key in scalars}
        if "alpha_final" in rows[0]:
            depths = range(len(rows[0]["alpha_final"]))
            out[arm]["alpha_final"] = [mean(r["alpha_final"][i] for r in rows) for i in depths]
    reference = out.get(REFERENCE, {}).get("tau_final")
    for arm, stats in out.items():
        if arm == REFERENCE or reference is None or "tau_final" not in stats:
            continue
        if min(len(per_seed[arm]), len(per_seed[REFERENCE])) < 2:
            stats["vs_growmtp"] = "one seed: no claim"
            continue
        mine = stats["tau_final"]
        stats["vs_growmtp"] = ("below" if mine["max"] < reference["min"] else
                               "above" if mine["min"] > reference["max"] else "within the seed spread")
    return out


def table(per_seed: dict[str, dict[int, dict]], stats: dict) -> str:
    """One line per arm: means over seeds, with the range where there is more than one seed."""
    def cell(arm: str, key: str, width: int, digits: int = 2) -> str:
        value = stats[arm].get(key)
        if value is None:
            return f"{'-':>{width}}"
        spread = value["max"] - value["min"]
        text = f"{value['mean']:.{digits}f}" + (f"±{spread / 2:.{digits}f}" if len(per_seed[arm]) > 1 else "")
        return f"{text:>{width}}"

    head = (f"{'arm':<38}{'τ first':>11}{'τ final':>11}{'τ max':>11}{'α final':>18}{'reward mean':>14}"
            f"{'reward final':>14}{'head s':>11}{'rollout s':>11}  vs GrowMTP")
    lines = [head]
    for arm, seeds in per_seed.items():
        alpha = stats[arm].get("alpha_final")
        alpha_text = " " + " ".join(f"{a:.2f}" for a in alpha) if alpha else "-"  # K=5 fills the column
        lines.append(f"{ARMS[arm].label:<38}{cell(arm, 'tau_first', 11)}{cell(arm, 'tau_final', 11)}"
                     f"{cell(arm, 'tau_max', 11)}{alpha_text:>31}{cell(arm, 'reward_mean', 14, 3)}"
                     f"{cell(arm, 'reward_final', 14, 3)}{cell(arm, 'head_update_s', 11)}"
                     f"{cell(arm, 'rollout_s', 11)}  {stats[arm].get('vs_growmtp', '')}")
    return "\n".join(lines)


def plot(out_dir: Path, rows: dict[str, dict[int, list[dict]]], k: int) -> list[Path]:
    """tau.png (τ per step, per arm: mean over seeds, band = range), alpha.png (final α_k per arm, one panel
    per position) and reward.png (reward per step per arm)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(arm: str, field: str, index: int | None = None):
        runs = list(rows[arm].values())
        steps = [r["step"] for r in runs[0]]
        values = [[(r[field] if index is None else r[field][index]) for r in run] for run in runs]
        per_step = list(zip(*values))
        return steps, [mean(v) for v in per_step], [min(v) for v in per_step], [max(v) for v in per_step]

    written = []

    def save(fig, name):
        fig.tight_layout()
        written.append(out_dir / name)
        fig.savefig(written[-1], dpi=90)
        plt.close(fig)

    for field, name, ylabel in (("tau", "tau.png", "τ (tokens per target forward)"), ("reward", "reward.png",
                                                                                        "mean reward")):
        fig, ax = plt.subplots(figsize=(9, 5))
        for i, arm in enumerate(rows):
            if field not in rows[arm][next(iter(rows[arm]))][0]:
                continue
            steps, avg, lo, hi = series(arm, field)
            ax.plot(steps, avg, color=f"C{i}", label=ARMS[arm].label, lw=1.2)
            ax.fill_between(steps, lo, hi, color=f"C{i}", alpha=0.15)
        ax.set(xlabel="RL step", ylabel=ylabel, title=f"{field} per arm (mean over seeds, band: range)")
        ax.legend(fontsize="small", ncol=2)
        save(fig, name)

    drafting = [arm for arm in rows if ARMS[arm].drafts]
    fig, axes = plt.subplots(1, k, figsize=(4 * k, 4.5), sharey=True, squeeze=False)
    for position, ax in enumerate(axes[0]):
        finals = [[mean(r["alpha"][position] for r in run[-final_window(len(run)):]) for run in rows[arm].values()]
                  for arm in drafting]
        ax.bar(range(len(drafting)), [mean(f) for f in finals],
               yerr=[[mean(f) - min(f) for f in finals], [max(f) - mean(f) for f in finals]],
               color=[f"C{list(rows).index(arm)}" for arm in drafting])
        ax.set_xticks(range(len(drafting)), drafting, rotation=60, ha="right", fontsize="small")
        ax.set(title=f"final α{position + 1}", ylim=(0, 1))
    save(fig, "alpha.png")
    return written


def mean_topk_mass(runs_by_seed: dict[int, list[dict]]) -> float | None:
    """The recorded top-k's mean share of the target's mass at draft positions, over every step of these runs
    (what the trainer's α estimates lean on: the sparse α exceeds the true one by at most 1 minus it)."""
    values = [row["head_topk_mass"] for rows in runs_by_seed.values() for row in rows if "head_topk_mass" in row]
    return mean(values) if values else None


def write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")

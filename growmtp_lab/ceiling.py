"""The ceiling of the demo's head: the same head trained offline, to convergence, for one fixed policy.

    python -m growmtp_lab.ceiling --policy runs/ablations/growmtp-s42/final \\
        --head runs/ablations/growmtp-s42/final/growmtp_head --prompts <world>/prompts.jsonl --k 3 --out ceiling.json

The online head chases a moving policy with one Adam step per RL step. Here the policy is fixed (a run's
final export) and the head gets as many steps as it can use. Each round:
1. the speculative engine samples the policy's rollouts on training prompts, drafting with the current
   head, and records them (the same capture as training);
2. the head is trained for `--epochs` passes over every round's records so far (`--objective`, DCA + VGM
   by default; Adam; transport-free hidden states of the fixed policy), starting from `--head`;
3. the trained head is loaded into the engine and evaluated on held-out prompts: τ from the engine's
   accepted counts, exactly as the online runs report it.
Rounds stop when τ gains less than `--tol`, or after `--rounds`. The result is the best τ reached: what a
perfect online learner of this head could hold on this policy. Prompts are disjoint from the ones the
online runs sample (their first `--skip` lines).

With `--k 1 --objective ce` from a random head it is the single-step MTP pretraining the paper's heads start
from: CE against the policy's recorded top-k at every response position, since at K=1 each cycle drafts one
token on the committed text.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

from openrlhf_growmtp.core.checkpoint import export_head, load_head  # noqa: E402
from openrlhf_growmtp.core.head_loss import HeadLossConfig, head_loss_backward  # noqa: E402
from openrlhf_growmtp.core.objectives import STATIC_OBJECTIVES  # noqa: E402


def read_prompts(path: Path, tokenizer, skip: int, count: int) -> list[list[int]]:
    lines = path.read_text().splitlines()[skip:skip + count]
    if len(lines) < count:
        raise ValueError(f"{path} has {len(lines) + skip} prompts; the ceiling needs {skip + count}")
    return [tokenizer(json.loads(line)["input"], add_special_tokens=False)["input_ids"] for line in lines]


def hidden_states(policy, records) -> list[torch.Tensor]:
    """The fixed policy's final-norm hidden states over each record's committed tokens."""
    with torch.no_grad():
        return [policy.model(rec.token_ids[None].long()).last_hidden_state[0] for rec in records]


def train(head, records, hiddens, epochs: int, lr: float, batch: int, seed: int,
          cfg: HeadLossConfig = HeadLossConfig()) -> float:
    """`epochs` shuffled passes of Adam over the records (the loss `cfg`); returns the last epoch's mean loss."""
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr)
    order, rng, loss = list(range(len(records))), random.Random(seed), float("nan")
    for _ in range(epochs):
        rng.shuffle(order)
        losses = []
        for lo in range(0, len(order), batch):
            picked = order[lo:lo + batch]
            optimizer.zero_grad(set_to_none=True)
            stats = head_loss_backward(head, [records[i] for i in picked], [hiddens[i] for i in picked], cfg)
            if not stats.finite:
                raise FloatingPointError("non-finite head loss while training the ceiling head")
            optimizer.step()
            losses.append(stats.loss)
        loss = sum(losses) / len(losses)
    return loss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m growmtp_lab.ceiling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", type=Path, required=True, help="the fixed policy (an HF export)")
    parser.add_argument("--head", type=Path, required=True, help="the head to start from (a head directory)")
    parser.add_argument("--prompts", type=Path, required=True, help="jsonl with an 'input' per line")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--topk", type=int, default=16)
    parser.add_argument("--skip", type=int, default=2048, help="prompt lines the online runs may have used")
    parser.add_argument("--train-prompts", type=int, default=256)
    parser.add_argument("--eval-prompts", type=int, default=256)
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=10,
                        help="passes over all records so far, per round")
    parser.add_argument("--objective", choices=STATIC_OBJECTIVES, default="dca",
                        help="the head's loss (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=64, help="records per Adam step")
    parser.add_argument("--tol", type=float, default=0.02, help="stop when a round gains less τ than this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="where the result's JSON goes")
    parser.add_argument("--save-head", type=Path, help="also export the best head to this directory")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    from vllm_patches.engine import SpecEngine

    began = time.perf_counter()
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    train_prompts = read_prompts(args.prompts, tokenizer, args.skip, args.train_prompts)
    eval_prompts = read_prompts(args.prompts, tokenizer, args.skip + args.train_prompts, args.eval_prompts)
    policy = AutoModelForCausalLM.from_pretrained(args.policy, dtype=torch.float32).eval()
    head = load_head(args.head, policy.model.embed_tokens, policy.lm_head).float()
    engine = SpecEngine(args.policy, args.head, args.k, capture=True, topk=args.topk, dtype="bfloat16",
                        enforce_eager=True, max_model_len=256, max_num_seqs=64, seed=args.seed)

    def rollouts(prompts):
        params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, n=1)
        return engine.generate([p for p in prompts for _ in range(args.samples)], params)

    def evaluate() -> dict:
        summary = rollouts(eval_prompts).metrics.acceptance
        return {"tau": summary.tau, "alpha": summary.alpha, "cycles": summary.cycles}

    start = evaluate()
    rounds, records, hiddens, best = [], [], [], start
    print(f"ceiling: start tau {start['tau']:.3f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="growmtp_ceiling_") as tmp:
        for r in range(1, args.rounds + 1):
            fresh = [rec for rec in rollouts(train_prompts).records if rec is not None and rec.num_cycles]
            records += fresh
            hiddens += hidden_states(policy, fresh)
            loss = train(head, records, hiddens, args.epochs, args.lr, args.batch, args.seed + r,
                         HeadLossConfig(objective=args.objective))
            exported = export_head(head, Path(tmp) / f"round{r}")
            engine.load_head(exported)
            result = {"round": r, "records": len(records), "loss": loss, **evaluate()}
            rounds.append(result)
            print(f"ceiling: round {r}: {len(records)} records, loss {loss:.4f}, tau {result['tau']:.3f}, "
                  f"alpha [{' '.join(f'{a:.2f}' for a in result['alpha'])}]", flush=True)
            gain = result["tau"] - best["tau"]
            if gain > 0 and args.save_head:
                shutil.copytree(exported, args.save_head, dirs_exist_ok=True)
            best = max(best, result, key=lambda row: row["tau"])
            if gain < args.tol:
                break
    out = {"ceiling_tau": best["tau"], "ceiling_alpha": best["alpha"], "start_tau": start["tau"],
           "start_alpha": start["alpha"], "rounds": rounds, "settings": {k: str(v) if isinstance(v, Path) else v
                                                                       for k, v in vars(args).items()},
           "wall_s": time.perf_counter() - began}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

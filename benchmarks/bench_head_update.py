"""The head update next to the policy's own training forward + backward on the same sequence, at Qwen3-4B's
proportions (hidden 2560, 32 query / 8 kv heads of 128, MLP 9728, tied vocabulary of 151,936, bf16).

What it times, on one response of --tokens tokens after a --prompt-token prompt:
- policy: a forward of the causal LM, the token log-probs of the sequence (log-softmax, gather), their
  mean as the loss, and the backward (the part of a GRPO step that grows with the model);
- head: `head_loss_backward` over the records of the same response (K=5, cycles drawn so that
  τ ≈ --tau, top-64), reading the policy's final hidden states as the trainer hands them over;
- own forward: the no-grad policy forward a head update runs where it cannot read H_p from the policy's
  training forward (several policy steps per RL step, the lag probe, joint mode).

Scaling to 36 layers. The policy's time is a + b·L for L identical decoder layers: b is one layer's forward
and backward at this length (attention's quadratic part included), a is everything else (embedding, final
norm, lm_head and loss). One policy of max(--depths) layers runs at each depth of --depths (its first L
layers: transformers' Qwen3 runs `config.num_hidden_layers` of them), and a least-squares line through
(L, time) is read at L = 36, Qwen3-4B's depth. The head update reads the final hidden states only, so its
time does not depend on L. `ratio` = head update / policy at 36 layers; `ratio_with_own_forward` =
(head update + own forward at 36 layers) / policy at 36 layers.

Noise. Each of --rounds rounds times every depth (policy and own forward) and the head update once, in an
order rotated from round to round, so that a slow spell of a shared machine falls on different parts in
different rounds. The reported ratio is the one of the per-depth medians' fit; each round's own fit gives
a ratio too, and their median, minimum and maximum are printed as the spread: one run says where the
ratio is and how far one round of it can be off. Peak memory (one more run of the head and of the deepest
policy) is CUDA's peak on a GPU, else the sampled peak of the bytes malloc has handed out above the models
(`shared/peak_memory.PeakMemory`).

    python -m benchmarks.bench_head_update [--tokens 2048] [--tau 3] [--depths 1,2,3,4] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import Qwen3ForCausalLM

from benchmarks.shared.peak_memory import measure_peak
from benchmarks.shared.bench_common import fit_line, head_update, policy_step, qwen3_4b_config, records_at_tau, sync
from openrlhf_growmtp.core import MTPHead, init_random_head_, make_head_config
from openrlhf_growmtp.core.families import get_family

K, TOPK, REAL_LAYERS = 5, 64, 36


def build_policy(num_layers: int, device: str, dtype: torch.dtype) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = qwen3_4b_config(num_layers)
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config).to(device=device, dtype=dtype).train()


def seconds(fn, device: str):
    sync(device)
    t0 = time.perf_counter()
    value = fn()
    sync(device)
    return value, time.perf_counter() - t0


def ratios_of(depths, policy_s, forward_s, head_s) -> dict:
    """The 36-layer estimates and ratios from one set of times (per depth: policy, own forward; the head's)."""
    policy_fit, forward_fit = fit_line(depths, policy_s), fit_line(depths, forward_s)
    policy_36, forward_36 = policy_fit.at(REAL_LAYERS), forward_fit.at(REAL_LAYERS)
    return {"policy_fit": policy_fit.as_dict(), "forward_fit": forward_fit.as_dict(), "policy_s_36_layers": policy_36,
            "own_forward_s_36_layers": forward_36, "head_update_s": head_s, "ratio": head_s / policy_36,
            "ratio_with_own_forward": (head_s + forward_36) / policy_36}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="response length")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--tau", type=float, default=3.0)
    parser.add_argument("--chunk-cycles", type=int, default=1024)
    parser.add_argument("--depths", default="1,2,3,4", help="policy depths timed, comma-separated (two at least)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each timing every depth and the head once")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.depth_list = sorted({int(d) for d in args.depths.split(",")})
    if len(args.depth_list) < 2 or args.depth_list[0] < 1 or args.rounds < 1:
        parser.error(f"--depths needs two distinct depths >= 1 and --rounds >= 1; got {args.depths}, {args.rounds}")
    return args


class Sides:
    """What is timed, on one response: the policy (one model of the deepest depth, run at each depth) and its own
    no-grad forward, and the random head's update over the response's records (the head's gradients allocated
    beforehand: they exist across a step, and are not the update's memory)."""

    def __init__(self, args, dtype: torch.dtype = torch.bfloat16):
        self.args, self.deepest = args, max(args.depth_list)
        self.record = records_at_tau(args.tokens, args.prompt, args.tau, K, TOPK, vocab_size=4096, hidden_size=2560)
        self.ids = self.record.token_ids.to(args.device)
        self.policy = build_policy(self.deepest, args.device, dtype)
        self.config = self.policy.config
        head = MTPHead(make_head_config(self.config, get_family("qwen3")), self.policy.model.embed_tokens,
                       self.policy.lm_head)
        self.head = init_random_head_(head, 0).to(device=args.device, dtype=dtype)
        for p in self.head.parameters():
            p.grad = torch.zeros_like(p)
        self.hiddens = [self.policy_at(self.deepest)().to(dtype)]  # also the policy's warm-up

    def policy_at(self, depth: int):
        def step():
            self.config.num_hidden_layers = depth
            self.policy.zero_grad(set_to_none=True)
            return policy_step(self.policy, self.ids[None])[0]
        return step

    def forward_at(self, depth: int):
        def forward():
            self.config.num_hidden_layers = depth
            with torch.no_grad():
                return self.policy.model(input_ids=self.ids[None]).last_hidden_state
        return forward

    def update(self):
        for p in self.head.parameters():
            p.grad.zero_()
        return head_update(self.head, [self.record], self.hiddens, self.args.chunk_cycles)

    def rounds(self) -> tuple[dict, object]:
        """Seconds per (kind, depth) per round, every round in an order rotated from the last; the last update's
        stats."""
        depths = self.args.depth_list
        stats = self.update()  # warm-up
        tasks = [("policy", d) for d in depths] + [("forward", d) for d in depths] + [("head", None)]
        times = {task: [] for task in tasks}
        for r in range(self.args.rounds):
            shift = r % len(tasks)  # each round starts one task later
            for kind, depth in tasks[shift:] + tasks[:shift]:
                at = self.policy_at if kind == "policy" else self.forward_at
                fn = self.update if kind == "head" else at(depth)
                value, s = seconds(fn, self.args.device)
                if kind == "head":
                    stats = value
                times[(kind, depth)].append(s)
        self.config.num_hidden_layers = self.deepest
        return times, stats


def report(args, sides: Sides, times: dict, stats, result: dict) -> None:
    depths, median, pooled = args.depth_list, result["median"], result["pooled"]
    print(f"Qwen3-4B proportions (H=2560, V=151,936, bf16), device={args.device}; one sequence of "
          f"{result['tokens']} tokens ({args.prompt} prompt), {sides.record.num_cycles} cycles at K={K}, "
          f"τ={result['tau']:.2f}; {args.rounds} rounds")
    for d in depths:
        print(f"  policy fwd+bwd, {d} layer(s): {median[('policy', d)]:8.2f} s (rounds "
              f"{min(times[('policy', d)]):.2f}-{max(times[('policy', d)]):.2f})   own forward "
              f"{median[('forward', d)]:.2f} s")
    fit = pooled["policy_fit"]
    print(f"  fit a + b·L: b = {fit['b']:.2f} s per layer, a = {fit['a']:.2f} s (residuals "
          + ", ".join(f"{x:+.2f}" for x in fit["residuals"]) + f") -> {REAL_LAYERS} layers: "
          f"{pooled['policy_s_36_layers']:.1f} s")
    print(f"  head update             : {median[('head', None)]:8.2f} s (rounds {min(times[('head', None)]):.2f}-"
          f"{max(times[('head', None)]):.2f})   peak {result['head_mb']:7.0f} MB (policy at {max(depths)} layers "
          f"{result['policy_mb']:.0f} MB; finite: {stats.finite})")
    ratio, own = result["ratio_spread"], result["own_spread"]
    print(f"  ratio head update / policy training at 36 layers: {pooled['ratio']:.3f}   per round: median "
          f"{ratio['median']:.3f}, min {ratio['min']:.3f}, max {ratio['max']:.3f}")
    print(f"  with a no-grad policy forward of its own ({pooled['own_forward_s_36_layers']:.1f} s at {REAL_LAYERS} "
          f"layers): {pooled['ratio_with_own_forward']:.3f}   per round: median {own['median']:.3f}, "
          f"min {own['min']:.3f}, max {own['max']:.3f}")


def main() -> None:
    args = parse_args()
    depths = args.depth_list
    sides = Sides(args)
    times, stats = sides.rounds()
    per_round = [ratios_of(depths, [times[("policy", d)][r] for d in depths],
                           [times[("forward", d)][r] for d in depths], times[("head", None)][r])
                 for r in range(args.rounds)]
    median = {key: statistics.median(v) for key, v in times.items()}
    pooled = ratios_of(depths, [median[("policy", d)] for d in depths], [median[("forward", d)] for d in depths],
                       median[("head", None)])
    result = {"median": median, "pooled": pooled, "tokens": int(sides.ids.shape[0]),
              "tau": 1.0 + float(sides.record.accepted.float().mean()),
              "head_mb": measure_peak(sides.update, args.device)[1],  # like the policy's: allocated, not resident
              "policy_mb": measure_peak(sides.policy_at(max(depths)), args.device)[1],
              "ratio_spread": spread([r["ratio"] for r in per_round]),
              "own_spread": spread([r["ratio_with_own_forward"] for r in per_round])}
    report(args, sides, times, stats, result)
    if args.json:
        print(json.dumps({"device": args.device, "tokens": result["tokens"], "cycles": sides.record.num_cycles, "k": K,
                          "tau": result["tau"], "depths": depths, "rounds": args.rounds,
                          "policy_s_by_layers": {d: times[("policy", d)] for d in depths},
                          "own_forward_s_by_layers": {d: times[("forward", d)] for d in depths},
                          "head_update_s_by_round": times[("head", None)], "policy_fit": pooled["policy_fit"],
                          "policy_s_36_layers": pooled["policy_s_36_layers"], "head_update_s": pooled["head_update_s"],
                          "head_peak_mb": result["head_mb"], "policy_peak_mb": result["policy_mb"],
                          "ratio": pooled["ratio"], "ratio_spread": result["ratio_spread"],
                          "own_forward_s_36_layers": pooled["own_forward_s_36_layers"],
                          "ratio_with_own_forward": pooled["ratio_with_own_forward"],
                          "ratio_with_own_forward_spread": result["own_spread"]}))


if __name__ == "__main__":
    main()

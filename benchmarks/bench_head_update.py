"""The head update next to the policy's own training forward + backward on the same sequence, at Qwen3-4B's
proportions (hidden 2560, 32 query / 8 kv heads of 128, MLP 9728, tied vocabulary of 151,936, bf16).

What it times, on one response of --tokens tokens after a --prompt-token prompt:
- policy: a forward of the causal LM, the token log-probs of the sequence (log-softmax, gather), their
  mean as the loss, and the backward (the part of a GRPO step that grows with the model);
- head: `head_loss_backward` over the records of the same response (K=5, cycles drawn so that
  τ ≈ --tau, top-64), reading the policy's final hidden states as the trainer hands them over.

Scaling to 36 layers. The policy's time is a + b·L for L identical decoder layers: b is one layer's
forward and backward at this length (attention's quadratic part included), a is everything else
(embedding, final norm, lm_head and loss). Two policies with 1 and 3 layers give b = (T(3) - T(1)) / 2
and a = T(1) - b, hence T(36) = a + 36·b, Qwen3-4B's depth (times are medians of --repeats runs). The head
update reads the final hidden states only, so its time does not depend on L. `ratio` = head update / T(36).

Where the trainer cannot take H_p from the policy's own training forward (several policy steps per RL
step, the lag probe, joint mode), the head runs a no-grad forward of the policy of its own; its time at
36 layers is scaled the same way from 1 and 3 layers, and `ratio_with_own_forward` = (head update + that
forward) / T(36). Peak memory is CUDA's peak on a
GPU, else the sampled peak of the bytes malloc has handed out above the models (see
bench_reconstruction.PeakMemory).

    python benchmarks/bench_head_update.py [--tokens 2048] [--tau 3] [--json] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from bench_common import head_update, policy_step, qwen3_4b_config, records_at_tau, sync
from bench_reconstruction import measure_peak
from transformers import Qwen3ForCausalLM

from openrlhf_growmtp.core import MTPHead, init_random_head_, make_head_config
from openrlhf_growmtp.core.families import get_family

K, TOPK, REAL_LAYERS = 5, 64, 36
LAYERS = (1, 3)  # the two depths the per-layer time is taken from


def build_policy(num_layers: int, device: str, dtype: torch.dtype) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = qwen3_4b_config(num_layers)
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config).to(device=device, dtype=dtype).train()


def timed(fn, device: str, repeats: int):
    """(last value, median seconds over `repeats` runs, peak MB of one more run under the memory sampler);
    `fn` resets what it accumulates."""
    seconds = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        seconds.append(time.perf_counter() - t0)
    value, peak, _ = measure_peak(fn, device)
    return value, statistics.median(seconds), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="response length")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--tau", type=float, default=3.0)
    parser.add_argument("--chunk-cycles", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each; medians are reported")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    dtype = torch.bfloat16

    record = records_at_tau(args.tokens, args.prompt, args.tau, K, TOPK, vocab_size=4096, hidden_size=2560)
    ids = record.token_ids.to(args.device)
    length = int(ids.shape[0])
    policy_s, policy_mb, forward_s, hidden = {}, {}, {}, None
    few, more = LAYERS
    for layers in LAYERS:
        policy = build_policy(layers, args.device, dtype)
        policy_step(policy, ids[None, :64])  # first-call overheads out of the timing

        def step():
            policy.zero_grad(set_to_none=True)
            return policy_step(policy, ids[None])[0]

        hidden, policy_s[layers], policy_mb[layers] = timed(step, args.device, args.repeats)

        def own_forward():
            with torch.no_grad():
                return policy.model(input_ids=ids[None]).last_hidden_state

        _, forward_s[layers], _ = timed(own_forward, args.device, args.repeats)
        if layers != more:
            del policy
    per_layer = (policy_s[more] - policy_s[few]) / (more - few)
    rest = policy_s[few] - few * per_layer
    policy_36 = rest + REAL_LAYERS * per_layer
    forward_per_layer = (forward_s[more] - forward_s[few]) / (more - few)
    forward_36 = forward_s[few] + (REAL_LAYERS - few) * forward_per_layer

    head = MTPHead(make_head_config(policy.config, get_family("qwen3")), policy.model.embed_tokens, policy.lm_head)
    head = init_random_head_(head, 0).to(device=args.device, dtype=dtype)
    hiddens = [hidden.to(dtype)]
    for p in head.parameters():  # the head's gradients exist across a step: not the update's memory
        p.grad = torch.zeros_like(p)

    def update():
        for p in head.parameters():
            p.grad.zero_()
        return head_update(head, [record], hiddens, args.chunk_cycles)

    stats, head_s, head_mb = timed(update, args.device, args.repeats)
    tau = 1.0 + float(record.accepted.float().mean())
    ratio = head_s / policy_36
    ratio_own_forward = (head_s + forward_36) / policy_36

    print(f"Qwen3-4B proportions (H=2560, V=151,936, bf16), device={args.device}; one sequence of {length} tokens "
          f"({args.prompt} prompt), {record.num_cycles} cycles at K={K}, τ={tau:.2f}")
    for layers in LAYERS:
        print(f"  policy fwd+bwd, {layers} layer(s): {policy_s[layers]:8.2f} s   peak {policy_mb[layers]:7.0f} MB")
    print(f"  per layer b = {per_layer:.2f} s, the rest a = {rest:.2f} s -> {REAL_LAYERS} layers: {policy_36:.1f} s "
          f"(medians of {args.repeats})")
    print(f"  head update             : {head_s:8.2f} s   peak {head_mb:7.0f} MB   (finite: {stats.finite})")
    print(f"  ratio head update / policy training at 36 layers: {ratio:.3f}")
    print(f"  with a no-grad policy forward of its own ({forward_36:.1f} s at {REAL_LAYERS} layers, from "
          f"{forward_s[few]:.2f} / {forward_s[more]:.2f} s): {ratio_own_forward:.3f}")
    if args.json:
        print(json.dumps({"device": args.device, "tokens": length, "cycles": record.num_cycles, "k": K, "tau": tau,
                          "policy_s_by_layers": policy_s, "policy_peak_mb_by_layers": policy_mb,
                          "policy_s_per_layer": per_layer, "policy_s_36_layers": policy_36,
                          "head_update_s": head_s, "head_peak_mb": head_mb, "ratio": ratio,
                          "own_forward_s_36_layers": forward_36, "ratio_with_own_forward": ratio_own_forward}))


if __name__ == "__main__":
    main()

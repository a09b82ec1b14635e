"""What a training head (any mode but `frozen`) needs of upstream's training layout: the ZeRO stage, the
optimizer, and policy steps that fall on whole windows of the rollout's samples. Upstream's flags only: no
`--growmtp_*` flag is registered here."""

from __future__ import annotations

SUPPORTED_STAGES = (2, 3)  # DeepSpeed ZeRO stages whose optimizer trainer/head_step/ knows


def policy_steps_per_rl_step(rollout_batch: int, samples_per_prompt: int, train_batch: int, epochs: int) -> int:
    """Policy optimizer steps per RL step: mini-batches x epochs, counted as upstream counts its max_steps
    (dynamic batching changes the micro-batches of a step, not the number of steps)."""
    return rollout_batch * samples_per_prompt // max(train_batch, 1) * epochs


def check_training_layout(flat: dict) -> list[str]:
    """The layout's problems for a training head (`flat`: the parsed namespace's dict)."""
    errors, get = [], flat.get
    if get("ds.zero_stage") not in SUPPORTED_STAGES:
        errors.append(f"GrowMTP trains the head in its own param group of DeepSpeed's ZeRO-2 or ZeRO-3 optimizer: "
                      f"set --ds.zero_stage 2 or 3 (got {get('ds.zero_stage')})")
    rollout_batch, per_prompt = get("rollout.batch_size") or 0, get("rollout.n_samples_per_prompt") or 1
    train_batch = get("train.batch_size") or 1
    if rollout_batch * per_prompt % train_batch and not get("train.dynamic_batch_enable"):
        # upstream then runs a last, partial window of micro-batches: the head would read it as a step of the
        # rollout policy (the policy has stepped) and count a head step that the RL step does not take
        errors.append(f"--train.batch_size {train_batch} must divide the rollout's {rollout_batch * per_prompt} "
                      "samples (--rollout.batch_size x --rollout.n_samples_per_prompt) for a training head")
    if get("actor.optim") == "muon":  # before: refused only once Ray, the engines and the model were up
        errors.append("--actor.optim muon is not supported with a training GrowMTP head: its param group needs "
                      "the Adam path (--actor.optim adam, or --growmtp_mode frozen)")
    # Joint mode backpropagates the head loss through one backbone graph of the rollout policy, built before
    # the policy's step: with a second policy step that graph would describe weights already changed.
    steps = policy_steps_per_rl_step(rollout_batch, per_prompt, train_batch, get("train.max_epochs") or 1)
    if get("growmtp.mode") == "joint" and get("ds.adam_offload"):
        # the joint head runs in a window's first micro-batch only; offloaded optimizers take each parameter's
        # gradient from the window's last backward that reaches it
        errors.append("--growmtp_mode joint is not supported with --ds.adam_offload")
    if get("growmtp.mode") == "joint" and steps != 1:
        errors.append("--growmtp_mode joint needs exactly one policy step per RL step (got "
                      f"{steps}): --train.batch_size equal to --rollout.batch_size x --rollout.n_samples_per_prompt "
                      "and --train.max_epochs 1")
    return errors

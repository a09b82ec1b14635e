"""The head's part of an RL step on a policy rank: `head_rl_step.HeadRLStep` and what only it uses.

- `head_rl_step.py`: `HeadRLStep` (its head updates and head steps) and its settings, read once;
- `schedules.py`: which records are due at a micro-batch;
- `hidden_states.py`: where the head's H_p come from (a forward of its own, or the policy's training forward);
- `head_update.py`: one head update on a rank's records, and its totals;
- `head_optimizer.py`: the head's optimizer step, at run time (`HeadOptimizer` owns the accumulation windows);
- `deepspeed_patches.py`: the head's group in DeepSpeed's ZeRO optimizer, patched once at install;
- `upstream_actor.py`: named accessors into upstream's actor-side trainer.
"""

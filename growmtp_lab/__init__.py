"""Research tooling, not the product: the CPU worlds and the runs made in them.

- `worlds/`: the worlds the runs and tests train in (the demo's worked additions, the paper's proportions,
  the tests' and benchmarks' toy), each with its reward file;
- `recipes.py`: each world's GRPO run through the training CLI; `report.py`: its table, summary and plots;
- `demo.py` (`make demo`), `reproduce.py` (`make reproduce`), `ablations.py` with `ablation_arms.py` and
  `ceiling.py` (`make ablations`);
- `rehearsal/` and `rehearse.py`: `GROWMTP_REHEARSAL=1`, the example scripts' own flags on CPU stand-ins.

The product (core, trainer, vllm_patches, cli, data, rewards) imports nothing from here.
"""

"""Math answers: `extract` finds the final answer, `dapo` and `symbolic` are the two rules, `score` picks one."""

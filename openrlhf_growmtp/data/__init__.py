"""Prompt data for GrowMTP runs: the paper's training sets and held-out benchmarks, as OpenRLHF jsonl rows.

`sources` reads a dataset's rows from a local file or folder or the hub; every converter in `loaders` yields rows
`{"id": str, "prompt": [{"role": "user", "content": str}], "label": str}`
for `--data.input_key prompt --data.label_key label --data.apply_chat_template`; math labels are the answer
string, code labels are `json.dumps({"inputs": [...], "outputs": [...]})` of stdin/stdout tests.
"""

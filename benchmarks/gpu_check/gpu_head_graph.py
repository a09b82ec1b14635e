"""Check `head_update_graph` of the GPU check: the head update for chunks of one fixed shape, captured once in a
CUDA graph and replayed per chunk, against the eager update (`head_loss_backward`) and the policy's forward +
backward over the same responses.

The fixed shape. The eager update builds, per chunk, only the slots VGM keeps and cuts its attention into
blocks by the chunk's starts: shapes change from chunk to chunk and the host reads them. Here a chunk is
`rows` rows of `cycles_per_row` cycles of one response each (a response's cycles fill whole rows, its last row
padded with cycles of weight 0), every row holding its response's hidden states [T, H] (responses padded to
one length). Within a row the cycles are sorted by chain length, longest first, so draft position j builds
its first `caps[j]` cycles of every row: `caps` is the batch's largest count of chains reaching j (fixed for
every chunk of the batch, so one graph serves them all). Draft position j's queries see, through one SDPA
call, the row's prefix entries p <= s (the entry at s is the chain's first), and their own chain entries of
positions 2..j (a diagonal mask over the earlier positions' rows). Scores, the objective and the backward are
the core's: `TopKLogQ` (log q at the recorded top-64 over the full vocabulary, blockwise) and
`head_loss_per_cycle_at` (DCA + VGM), each cycle weighted 1 / cycles as the batch loss is a mean.
So it computes the eager update's function: on a CPU, `chunk_update` run eagerly is tested against
`head_loss_backward` in fp64 (tests/benchmarks), and in --tiny as a row. On CUDA the same function is captured.

Numerics, bf16 (check (a)'s bounds, `gpu_numerics.py`): eps = the eager update's distance from the eager
update in fp64 (per gradient tensor, an L2 norm), and the captured path's distance from the eager one must
stay within noise_factor(bf16) x eps + u x |fp64|; the loss within the same factor of the eager loss's own
error plus the fp32 sum's rounding. On a small batch of (a)'s size.

Timed, medians of `repeats`, over `responses` responses of (c)'s shape (a prompt and ~4,096 tokens at tau 3):
the policy's forward + backward (`bench_common.policy_step`), the eager update at each chunk and the captured
one at the same cycles per chunk (the captured time includes copying each chunk into the graph's inputs and
adding its gradients into .grad). The shares are beside the eager 0.238 (check (c) on the H100, chunk 4096).
On CUDA, torch's profiler counts the kernels each update runs, per cycle.

With a draft vocabulary (`--draft-vocab N`) each chunk size is also timed over N ids alone, eager and captured
(logits from the lm_head's N rows, `core/draft_vocab.DraftRows`, sliced once and held by the graph).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from benchmarks.gpu_check.gpu_cost import make_records
from benchmarks.gpu_check.gpu_numerics import _compare_grads, noise_factor, unit_roundoff
from benchmarks.gpu_check.gpu_numerics import make_records as numerics_records
from benchmarks.gpu_check.gpu_report import Row, sci
from benchmarks.gpu_check.gpu_world import head_copy
from benchmarks.shared.bench_common import head_update, median_seconds, policy_hiddens, sync
from benchmarks.shared.cycle_timing import MaskedGQA
from openrlhf_growmtp.core import HeadLossConfig, MTPHead, SequenceRecord, head_loss_backward
from openrlhf_growmtp.core.draft_vocab import DraftVocab
from openrlhf_growmtp.core.objectives import chain_lengths, head_loss_per_cycle_at
from openrlhf_growmtp.core.topk_logq import TopKLogQ

EAGER_SHARE_H100 = 0.238  # check (c), H100, chunk 4096 (docs/gpu.md)
# per plan: responses timed, chunks (cycles), cycles per row, repeats
SIZES = {"Qwen3-4B": {"responses": 6, "chunks": (1024, 4096), "cycles_per_row": 512, "repeats": 3},
         "tiny": {"responses": 4, "chunks": (32, 128), "cycles_per_row": 32, "repeats": 2}}


@dataclass
class FixedChunk:
    """One chunk's inputs, every tensor of a fixed shape (S rows, M cycles a row, T tokens, K, top-k)."""

    hidden: torch.Tensor  # [S, T, H] the rows' responses' H_p
    tokens: torch.Tensor  # [S, T]
    start: torch.Tensor  # [S, M] s per cycle, longest chains first within a row
    drafts: torch.Tensor  # [S, M, K]
    topk_ids: torch.Tensor  # [S, M, K, k]
    topk_logprobs: torch.Tensor  # [S, M, K, k]
    accepted: torch.Tensor  # [S, M]
    weight: torch.Tensor  # [S, M] 1 / the batch's cycles; 0 for padding
    temperature: torch.Tensor  # [S, M]

    def fields(self) -> dict:
        return dict(self.__dict__)

    def copy_(self, other: "FixedChunk") -> None:
        for name, t in self.fields().items():
            t.copy_(getattr(other, name))


class Packed:
    """A batch's records as rows of fixed shape, `rows` rows a chunk (module docstring)."""

    def __init__(self, records: list[SequenceRecord], hiddens: list[torch.Tensor], cycles_per_row: int, rows: int,
                 device):
        if cycles_per_row < 1 or rows < 1:
            raise ValueError(f"cycles_per_row and rows must be >= 1, got {cycles_per_row}, {rows}")
        depth, topk = records[0].depth, int(records[0].topk_ids.shape[-1])
        length = max(int(r.token_ids.numel()) for r in records)
        hidden_size = hiddens[0].shape[-1]
        total = sum(r.num_cycles for r in records)
        self.hidden = torch.zeros(len(records), length, hidden_size, dtype=hiddens[0].dtype, device=device)
        self.tokens = torch.zeros(len(records), length, dtype=torch.long, device=device)
        fields = {name: [] for name in ("start", "drafts", "topk_ids", "topk_logprobs", "accepted", "weight",
                                        "temperature")}
        record_of_row = []
        for i, (rec, hid) in enumerate(zip(records, hiddens)):
            n = int(rec.token_ids.numel())
            self.hidden[i, :n] = hid.to(device)
            self.tokens[i, :n] = rec.token_ids.to(device)
            lengths = chain_lengths(rec.accepted, rec.num_cycles, depth)
            for lo in range(0, rec.num_cycles, cycles_per_row):
                idx = torch.arange(lo, min(lo + cycles_per_row, rec.num_cycles))
                idx = idx[torch.argsort(lengths[idx], descending=True, stable=True)]
                pad = cycles_per_row - idx.numel()
                record_of_row.append(i)
                fields["start"].append(_pad(rec.start[idx], pad, 0))
                fields["drafts"].append(_pad(rec.drafts[idx], pad, 0))
                fields["topk_ids"].append(_pad(rec.topk_ids[idx], pad, 0))
                # a padding cycle's targets: uniform over the top-k, finite
                fields["topk_logprobs"].append(_pad(rec.topk_logprobs[idx].float(), pad, -math.log(topk)))
                fields["accepted"].append(_pad(rec.accepted[idx], pad, 0))
                fields["weight"].append(_pad(torch.full((idx.numel(),), 1.0 / total), pad, 0.0))
                fields["temperature"].append(_pad(torch.full((idx.numel(),), float(rec.temperature)), pad, 1.0))
        while len(record_of_row) % rows:  # whole chunks: empty rows of weight 0
            record_of_row.append(0)
            for name, values in fields.items():
                empty = torch.zeros_like(values[-1]) if name != "topk_logprobs" else torch.full_like(
                    values[-1], -math.log(topk))
                values.append(empty if name != "temperature" else torch.ones_like(values[-1]))
        self.rows = {name: torch.stack(values).to(device) for name, values in fields.items()}
        self.rows["topk_logprobs"] = self.rows["topk_logprobs"].to(records[0].topk_logprobs.dtype)
        self.record_of_row = torch.tensor(record_of_row, device=device)
        reach = chain_lengths(self.rows["accepted"].flatten(), self.rows["accepted"].numel(), depth).view(
            len(record_of_row), cycles_per_row)
        self.caps = tuple(max(1, int((reach > j).sum(1).max())) for j in range(depth))
        self.rows_per_chunk, self.cycles_per_row, self.num_cycles = rows, cycles_per_row, total
        self.num_chunks = len(record_of_row) // rows

    def chunk(self, c: int) -> FixedChunk:
        rows = slice(c * self.rows_per_chunk, (c + 1) * self.rows_per_chunk)
        record = self.record_of_row[rows]
        return FixedChunk(hidden=self.hidden[record], tokens=self.tokens[record],
                          **{name: t[rows] for name, t in self.rows.items()})


def _pad(t: torch.Tensor, pad: int, value: float) -> torch.Tensor:
    return torch.cat([t, torch.full((pad, *t.shape[1:]), value, dtype=t.dtype)]) if pad else t


class ChainStore:
    """The head layer's keys and values at one draft position: the rows' prefix entries, then the chain
    entries of positions 2..j-1 kept so far, then this position's own (`update`, the Cache duck type)."""

    def __init__(self, prefix_keys: torch.Tensor, prefix_values: torch.Tensor):
        self.keys, self.values, self.new = [prefix_keys], [prefix_values], None

    def update(self, key, value, layer_idx=0, cache_kwargs=None):
        self.new = key, value
        return torch.cat([*self.keys, key], dim=2), torch.cat([*self.values, value], dim=2)

    def keep(self) -> None:
        self.keys.append(self.new[0])
        self.values.append(self.new[1])

    def __len__(self) -> int:
        return sum(k.shape[2] for k in self.keys)

    def mask(self, seen_prefix: torch.Tensor, own: bool) -> torch.Tensor:
        """[S, 1, C, keys] bool for C queries: the prefix as `seen_prefix` [S, C, P] says, each query's own
        entries of the earlier positions and (`own`) of this one."""
        rows, count = seen_prefix.shape[0], seen_prefix.shape[1]
        device = seen_prefix.device
        parts = [seen_prefix]
        for key in self.keys[1:]:
            parts.append(torch.eye(count, key.shape[2], dtype=torch.bool, device=device).expand(rows, -1, -1))
        diagonal = torch.eye(count, dtype=torch.bool, device=device) if own else torch.zeros(
            count, count, dtype=torch.bool, device=device)
        parts.append(diagonal.expand(rows, -1, -1))
        return torch.cat(parts, dim=-1)[:, None]


def chunk_update(head: MTPHead, params: list[torch.nn.Parameter], chunk: FixedChunk, caps: tuple[int, ...]
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The weighted loss of one fixed-shape chunk and its gradients for `params` (no .grad touched, no value
    read back to the host: capturable). The module docstring says what it computes."""
    rows, length, hidden_size = chunk.hidden.shape
    topk = chunk.topk_ids.shape[-1]
    device = chunk.hidden.device
    with torch.enable_grad():
        prefix_positions = torch.arange(length - 1, device=device)
        keys, values = head.keys_values(chunk.hidden[:, :-1], chunk.tokens[:, 1:],
                                        prefix_positions.expand(rows, -1))
        seen_prefix = prefix_positions[None, None, :] <= chunk.start[:, :, None]  # [S, M, T - 1]
        store = ChainStore(keys, values)
        normed, ids, temperature, feed = [], [], [], None
        for j, count in enumerate(caps):
            start = chunk.start[:, :count]
            if j == 0:  # (H_s, x_{s+1}) at s
                inputs = chunk.hidden.gather(1, start[..., None].expand(-1, -1, hidden_size))
                tokens = chunk.tokens.gather(1, start + 1)
            else:  # (h'_{j-1}, d_{j-1}) at s + j - 1
                inputs, tokens = feed[:, :count], chunk.drafts[:, :count, j - 1]
            mask = store.mask(seen_prefix[:, :count], own=j > 0)
            out = head(inputs, tokens, start + j, cache=store, draft_path=MaskedGQA(mask))
            if j > 0:
                store.keep()
            feed = out.feed_back
            normed.append(out.normed.reshape(rows * count, hidden_size))
            ids.append(chunk.topk_ids[:, :count, j].reshape(rows * count, topk))
            temperature.append(chunk.temperature[:, :count].reshape(-1))
        normed = torch.cat(normed)
        scores = TopKLogQ(head, normed, torch.cat(ids), torch.cat(temperature))
        # positions a row does not build keep the target's own log p: finite, and read by nothing (VGM)
        logq, offset = chunk.topk_logprobs.float().clone(), 0
        for j, count in enumerate(caps):
            logq[:, :count, j] = scores.logq[offset:offset + rows * count].view(rows, count, topk)
            offset += rows * count
        cycles = chunk.start.numel()
        per_cycle, _ = head_loss_per_cycle_at(logq.view(cycles, len(caps), topk),
                                              chunk.topk_logprobs.view(cycles, len(caps), topk),
                                              chunk.accepted.view(cycles), "dca")
        loss = (per_cycle * chunk.weight.view(cycles)).sum()
        (grad_logq,) = torch.autograd.grad(loss, scores.logq)
        grads = torch.autograd.grad(normed, params, scores.input_grad(grad_logq), allow_unused=True)
    grads = tuple(torch.zeros_like(p) if g is None else g for p, g in zip(params, grads))
    return loss.detach(), grads


class CapturedUpdate:
    """`chunk_update` at one shape: captured in a CUDA graph on CUDA, called eagerly elsewhere. `run(packed)`
    adds every chunk's gradients into the params' .grad and returns the loss (a device tensor)."""

    def __init__(self, head: MTPHead, packed: Packed):
        self.head, self.caps = head, packed.caps
        self.rows = head.draft_rows  # a draft vocabulary's rows, which a captured graph reads: kept alive with it
        self.params = [p for p in head.parameters() if p.requires_grad]
        self.graph = None
        if next(head.parameters()).device.type == "cuda":
            first = packed.chunk(0)
            self.static = FixedChunk(**{name: t.clone() for name, t in first.fields().items()})
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    chunk_update(head, self.params, self.static, self.caps)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.loss, self.grads = chunk_update(head, self.params, self.static, self.caps)

    def run(self, packed: Packed) -> torch.Tensor:
        total = torch.zeros((), device=packed.hidden.device)
        for c in range(packed.num_chunks):
            if self.graph is not None:
                self.static.copy_(packed.chunk(c))
                self.graph.replay()
                loss, grads = self.loss, self.grads
            else:
                loss, grads = chunk_update(self.head, self.params, packed.chunk(c), self.caps)
            total += loss
            for p, g in zip(self.params, grads):
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.add_(g)
        return total


def _grads(head: MTPHead) -> dict[str, torch.Tensor]:
    out = {name: p.grad.detach().double().clone() for name, p in head.named_parameters() if p.grad is not None}
    head.zero_grad(set_to_none=True)
    return out


def eager_and_fixed(head: MTPHead, records, hiddens, cycles_per_row: int, rows: int) -> dict:
    """Loss and gradients of the project's update (one chunk) and of the fixed-shape one (captured on CUDA)."""
    head.zero_grad(set_to_none=True)
    eager = head_loss_backward(head, records, hiddens, HeadLossConfig(chunk_cycles=None))
    out = {"eager_loss": eager.loss, "eager": _grads(head)}
    packed = Packed(records, hiddens, cycles_per_row, rows, next(head.parameters()).device)
    out["fixed_loss"] = float(CapturedUpdate(head, packed).run(packed))
    out["fixed"] = _grads(head)
    return out


def check_numerics(plan, head: MTPHead) -> tuple[list[Row], dict]:
    """The captured bf16 update against the eager one, within check (a)'s bounds (module docstring)."""
    records = numerics_records(plan)
    device = head.embed_tokens.weight.device
    base = [r.hidden.to(device=device, dtype=torch.bfloat16) for r in records]
    per_row = max(r.num_cycles for r in records)
    runs = {}
    for dtype, h in ((torch.float64, head_copy(head, torch.float64)), (torch.bfloat16, head)):
        runs[dtype] = eager_and_fixed(h, records, [x.to(dtype) for x in base], per_row, 1)
    ref, bf16 = runs[torch.float64], runs[torch.bfloat16]
    u, factor = unit_roundoff(torch.bfloat16), noise_factor(torch.bfloat16)
    grads = _compare_grads(bf16["eager"], {"fixed": bf16["fixed"]}, ref["eager"], u, factor)
    cycles = sum(r.num_cycles for r in records)
    eps = abs(bf16["eager_loss"] - ref["eager_loss"])
    loss_tol = factor * eps + cycles * unit_roundoff(torch.float32) * abs(ref["eager_loss"])
    loss_diff = abs(bf16["fixed_loss"] - bf16["eager_loss"])
    # in an fp64 head both paths compute one function; both score log q in fp32 (TopKLogQ), in other groups,
    # so they differ by fp32 rounding summed over the cycles: at most cycles x u(fp32), relative
    exact_tol = cycles * unit_roundoff(torch.float32)
    exact = max(((ref["fixed"][n] - g).norm() / g.norm().clamp(min=1e-300)).item() for n, g in ref["eager"].items())
    exact_loss = abs(ref["fixed_loss"] - ref["eager_loss"]) / abs(ref["eager_loss"])
    what = "captured" if device.type == "cuda" else "fixed-shape, eager on CPU"
    rows = [Row("head_update_graph", f"gradients, {what} vs head_loss_backward, bf16, {cycles} cycles",
                f"worst |d|2/tol {grads['worst_ratio']:.2f} ({grads['worst_tensor']})",
                f"<= 1; cos vs fp64 >= {grads['min_cosine_vs_fp64']:.5f}", grads["worst_ratio"] <= 1.0, grads),
            Row("head_update_graph", f"loss, {what} vs head_loss_backward, bf16", f"|d| {sci(loss_diff)}",
                f"<= {sci(loss_tol)}", loss_diff <= loss_tol, {"diff": loss_diff, "tolerance": loss_tol}),
            Row("head_update_graph", f"fp64: {what} vs head_loss_backward (one function)",
                f"max rel |d|2 {sci(exact)}, loss {sci(exact_loss)}", f"<= cycles x u(fp32) = {sci(exact_tol)}",
                max(exact, exact_loss) <= exact_tol,
                {"grad_rel": exact, "loss_rel": exact_loss, "tolerance": exact_tol})]
    return rows, {"cycles": cycles, "gradients": grads, "loss": {"fixed": bf16["fixed_loss"],
                  "eager": bf16["eager_loss"], "fp64": ref["eager_loss"], "tolerance": loss_tol},
                  "fp64_grad_rel": exact, "fp64_loss_rel": exact_loss}


def kernels(fn, device) -> dict | None:
    """Kernels and launch calls (cudaLaunchKernel, cudaGraphLaunch, ...) torch's profiler sees in one `fn()`."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    events = prof.events()
    kernel = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in
                 e.name.lower() and "memset" not in e.name.lower())
    launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                   "cuLaunchKernelEx", "cudaGraphLaunch"))
    return {"kernels": kernel, "launch_calls": launches}


def check_head_update_graph(plan, policy, head: MTPHead, log, draft_vocab: int | None = None
                            ) -> tuple[list[Row], dict]:
    sizes = SIZES[plan.name]
    device = policy.device
    rows, numerics = check_numerics(plan, head)
    log(f"  (head_update_graph) numerics: gradients {rows[0].measured}, loss {rows[1].measured}")
    records = make_records(plan, sizes["responses"])
    for p in head.parameters():
        p.grad = None

    def policy_pass():
        policy.zero_grad(set_to_none=True)
        return policy_hiddens(policy, records, plan.micro_batch, device)

    hiddens = policy_pass()
    policy_s = median_seconds(policy_pass, device, sizes["repeats"])[0]
    policy.zero_grad(set_to_none=True)
    per_chunk = {}
    for chunk in sizes["chunks"]:
        d = per_chunk[chunk] = time_chunk(head, records, hiddens, chunk, sizes, device)
        d.update(eager_share=d["eager_s"] / policy_s, graph_share=d["graph_s"] / policy_s)
        kpc = d["kernels_per_cycle"]
        kern = "" if kpc["eager"] is None else f"; kernels/cycle {kpc['eager']:.2f} -> {kpc['graph']:.2f}"
        rows.append(Row("head_update_graph", f"share of policy fwd+bwd, chunk {chunk}: eager -> captured",
                        f"{d['eager_share']:.3f} -> {d['graph_share']:.3f}",
                        f"eager {EAGER_SHARE_H100} on the H100 at 4096 (check c){kern}; grads cos "
                        f"{d['min_grad_cosine_graph_vs_eager']:.4f}", None,
                        {"eager": d["eager_share"], "graph": d["graph_share"]}))
        log(f"  (head_update_graph) chunk {chunk}: eager {d['eager_s']:.3f} s, captured {d['graph_s']:.3f} s, "
            f"policy {policy_s:.3f} s")
        if draft_vocab is not None:
            from benchmarks.gpu_check.gpu_draft_vocab import draft_vocab_ids

            vocab = DraftVocab(draft_vocab_ids(plan.config.vocab_size, draft_vocab, torch.device("cpu")),
                               plan.config.vocab_size)
            sub = d["draft_vocab"] = time_chunk(head, records, hiddens, chunk, sizes, device, vocab)
            sub.update(size=vocab.size, eager_share=sub["eager_s"] / policy_s, graph_share=sub["graph_s"] / policy_s)
            rows.append(Row("head_update_graph", f"share of policy fwd+bwd over {vocab.size:,} ids, chunk {chunk}: "
                            "eager -> captured", f"{sub['eager_share']:.3f} -> {sub['graph_share']:.3f}",
                            f"every id: {d['eager_share']:.3f} -> {d['graph_share']:.3f}; grads cos "
                            f"{sub['min_grad_cosine_graph_vs_eager']:.4f}", None,
                            {"eager": sub["eager_share"], "graph": sub["graph_share"]}))
            log(f"  (head_update_graph) chunk {chunk} over {vocab.size} ids: eager {sub['eager_s']:.3f} s, captured "
                f"{sub['graph_s']:.3f} s")
    details = {"responses": len(records), "tokens": sum(int(r.token_ids.numel()) for r in records),
               "cycles": sum(r.num_cycles for r in records), "policy_s": policy_s,
               "per_chunk": {str(c): v for c, v in per_chunk.items()},
               "numerics": numerics, "eager_share_h100_check_c": EAGER_SHARE_H100,
               "path": "CUDA graph" if device.type == "cuda" else "fixed-shape function, eager (CPU)"}
    return rows, details


def time_chunk(head: MTPHead, records, hiddens, chunk: int, sizes: dict, device,
               vocab: DraftVocab | None = None) -> dict:
    """The eager update and the captured one at `chunk` cycles a chunk: medians of `repeats`, the gradients'
    agreement, the captured update's peak and (on CUDA) the kernels each runs; over `vocab`'s ids alone where
    given (its rows sliced once for the captured update, as the eager one slices them per update)."""
    head.draft_vocab = vocab
    try:
        with head.sliced_draft_rows():
            return _time_chunk(head, records, hiddens, chunk, sizes, device)
    finally:
        head.draft_vocab = None


def _time_chunk(head: MTPHead, records, hiddens, chunk: int, sizes: dict, device) -> dict:
    cycles = sum(r.num_cycles for r in records)
    per_row = min(sizes["cycles_per_row"], chunk)
    packed = Packed(records, hiddens, per_row, max(1, chunk // per_row), device)
    t0 = time.perf_counter()
    captured = CapturedUpdate(head, packed)
    capture_s = time.perf_counter() - t0

    def eager():
        head.zero_grad(set_to_none=True)
        head_update(head, records, hiddens, chunk)

    def graph():
        head.zero_grad(set_to_none=True)
        captured.run(packed)

    eager_s = median_seconds(eager, device, sizes["repeats"])[0]
    eager_grads = _grads(head)
    graph_s = median_seconds(graph, device, sizes["repeats"])[0]
    graph_grads = _grads(head)
    cosine = min(torch.nn.functional.cosine_similarity(graph_grads[n].flatten(), g.flatten(), dim=0).item()
                 for n, g in eager_grads.items())
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        graph()
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    count = {"eager": kernels(eager, device), "graph": kernels(graph, device)}
    head.zero_grad(set_to_none=True)
    return {"cycles_per_row": per_row, "rows_per_chunk": packed.rows_per_chunk,
            "graph_cycles_per_chunk": per_row * packed.rows_per_chunk, "chunks": packed.num_chunks,
            "caps": list(packed.caps),
            "padded_share": 1 - cycles / (packed.num_chunks * packed.rows_per_chunk * per_row),
            "capture_s": capture_s, "eager_s": eager_s, "graph_s": graph_s,
            "min_grad_cosine_graph_vs_eager": cosine, "graph_peak_mb": peak, "kernels": count,
            "kernels_per_cycle": {k: (v["kernels"] / cycles if v else None) for k, v in count.items()}}

"""A rehearsal world: tiny local stand-ins for the example scripts' models and datasets (nothing downloaded).

Per model preset, a checkpoint directory with the family's real config fields, real vocabulary size, real
special-token ids and the real checkpoint's tying and dtype (bf16), where only the widths and depth are
shrunk; MiMo's and Qwen3.5's checkpoints carry native MTP weights, as the real ones do. A byte-level BPE tokenizer of
the real tokenizer's length (trained on the rehearsal rows, then filled with placeholder tokens up to the
special-token ids) with a ChatML chat template, so prompts are rendered and counted as in a real run.
Per domain, a few raw rows in the source dataset's own schema (DAPO-Math-17k, TACO-Verified), so
`prepare_data` converts and caps them exactly as it does the real sets.

The weights are random but shaped like a trained model's output: the output embedding is scaled so that
next-token distributions over the full vocabulary are peaked (a near-uniform distribution over 151,936
tokens would leave the recorded top-64 log-probs with almost no mass, a regime no real policy is in).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PretrainedConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3Config
from transformers import Qwen3ForCausalLM
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

from openrlhf_growmtp.core.checkpoint import to_native_state_dict
from openrlhf_growmtp.core.families import family_for_backbone
from openrlhf_growmtp.core.head import MTPHead
from openrlhf_growmtp.core.head_config import make_head_config
from openrlhf_growmtp.data import loaders
from growmtp_lab.rehearsal import native_head

WORLD_VERSION = 3  # bump when anything below changes what a built world holds
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_BASE = 151643  # <|endoftext|> in every Qwen2/2.5/3 tokenizer; <|im_start|>, <|im_end|> follow
# Qwen3.5's <|endoftext|>: its specials keep Qwen3's layout 100,401 ids higher (transformers' Qwen3_5Config
# defaults put <|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|> at 248053, 248054, 248056,
# 248057, Qwen3's 151652, 151653, 151655, 151656 + 100,401)
QWEN3_5_SPECIAL_BASE = 248044
# Qwen's ChatML layout (without Qwen3's thinking-mode extras)
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Shrunk widths shared by every preset: head_dim 32 (vLLM's CPU attention needs >= 32), GQA 4:1 as in
# Qwen3-4B and MiMo-7B (32 query heads : 8 KV heads), 2 layers.
TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1, intermediate_size=384,
            num_hidden_layers=2)


class UnsupportedPresetError(ValueError):
    """A preset that cannot be rehearsed on this machine (the message says why)."""


class WeakNativeHeadError(RuntimeError):
    """The build's native head drafts below the preset's floor (the message gives its measured tau)."""


@dataclass(frozen=True)
class Preset:
    config: PretrainedConfig
    model_class: type
    tokenizer_len: int  # the real tokenizer's length (the embedding is padded beyond it)
    native_head: bool  # the checkpoint ships MTP weights
    special_base: int = SPECIAL_BASE  # id of <|endoftext|>; <|im_start|>, <|im_end|> follow
    # native head: the depths K its scripts run at (common.sh, ablation.sh, baseline_frozen_k1.sh), where the
    # build measures its realised tau, and the tau it must reach at the first of them (None: no floor)
    rehearsed_depths: tuple[int, ...] = ()
    min_native_tau: float | None = None


def _qwen3_4b() -> Preset:
    # Qwen/Qwen3-4B config.json, widths shrunk
    config = Qwen3Config(vocab_size=151936, head_dim=32, max_position_embeddings=40960, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
                         attention_bias=False, use_sliding_window=False, sliding_window=None,
                         max_window_layers=TINY["num_hidden_layers"], initializer_range=0.02, **TINY)
    config.architectures = ["Qwen3ForCausalLM"]
    return Preset(config, Qwen3ForCausalLM, tokenizer_len=151669, native_head=False)


def _mimo_7b_sft() -> Preset:
    # XiaomiMiMo/MiMo-7B-SFT config.json, widths shrunk. The real checkpoint says model_type "mimo" and
    # loads MiMo's remote code; its fields are Qwen2's plus num_nextn_predict_layers, and vLLM serves both
    # the same way (architecture MiMoForCausalLM), so the stand-in is a Qwen2 config under that architecture.
    config = Qwen2Config(vocab_size=151680, max_position_embeddings=32768, rope_theta=640000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
                         use_sliding_window=False, sliding_window=32768, max_window_layers=TINY["num_hidden_layers"],
                         num_nextn_predict_layers=1, initializer_range=0.02, **TINY)
    config.architectures = ["MiMoForCausalLM"]
    # the paper's weak native head: distilled as far as the budget takes it, no floor
    return Preset(config, Qwen2ForCausalLM, tokenizer_len=151665, native_head=True, rehearsed_depths=(5, 1))


def _qwen3_5_4b_base() -> Preset:
    # Qwen/Qwen3.5-4B-Base's text config (the language model of the released checkpoint, served as
    # Qwen3_5ForCausalLM), widths shrunk: 4 layers keep the real full_attention_interval (3 Gated DeltaNet
    # layers, then full attention); the GDN heads keep their real 128-dim keys and values and their 1:2
    # key:value head ratio (vLLM's CPU GDN kernels take 128-dim heads); attention keeps GQA 4:1. Partial
    # RoPE on a quarter of each head, interleaved M-RoPE sections in the real 11:11:10 proportions (scaled to
    # the 4 rotary pairs of a 32-dim head).
    tiny = {**TINY, "num_hidden_layers": 4}
    config = Qwen3_5TextConfig(vocab_size=248320, head_dim=32, max_position_embeddings=262144, rms_norm_eps=1e-6,
                               tie_word_embeddings=True, eos_token_id=QWEN3_5_SPECIAL_BASE, attention_bias=False,
                               linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                               linear_num_key_heads=1, linear_num_value_heads=2, full_attention_interval=4,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                                "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                                "mrope_section": [2, 1, 1]},
                               attn_output_gate=True, mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
                               initializer_range=0.02, **tiny)
    config.architectures = ["Qwen3_5ForCausalLM"]
    # the real tokenizer: 248,044 byte-level BPE tokens, then Qwen3's 26 specials from <|endoftext|> on
    # the paper's strong native head (its real one: tau 2.65 at K = 3, frozen): the stand-in's must draft
    return Preset(config, Qwen3_5ForCausalLM, tokenizer_len=QWEN3_5_SPECIAL_BASE + 26, native_head=True,
                  special_base=QWEN3_5_SPECIAL_BASE, rehearsed_depths=(3,), min_native_tau=1.5)


PRESETS = {"qwen3_4b": _qwen3_4b, "mimo_7b_sft": _mimo_7b_sft, "qwen3_5_4b_base": _qwen3_5_4b_base}
UNSUPPORTED: dict[str, str] = {}  # presets this machine cannot rehearse, with the reason


def preset(name: str) -> Preset:
    if name in UNSUPPORTED:
        raise UnsupportedPresetError(f"the {name} preset cannot be rehearsed on this machine: {UNSUPPORTED[name]}")
    if name not in PRESETS:
        raise UnsupportedPresetError(f"unknown model preset {name!r}; rehearsable: {sorted(PRESETS)}")
    return PRESETS[name]()


# ---------------------------------------------------------------------------------------------- datasets
MATH_PROBLEMS = [
    ("What is $17 + 25$?", "42"),
    ("Compute $3^4 - 2^5$.", "49"),
    ("How many positive divisors does $36$ have?", "9"),
    ("Find the remainder when $1000$ is divided by $7$.", "6"),
    ("What is the sum of the interior angles of a hexagon, in degrees?", "720"),
    ("If $2x + 3 = 17$, what is $x$?", "7"),
]
CODE_PROBLEMS = [
    ("Read two integers a and b and print their sum.", [("1 2\n", "3\n"), ("-5 5\n", "0\n")]),
    ("Read a line of text and print it reversed.", [("abc\n", "cba\n"), ("racecar\n", "racecar\n")]),
    ("Read an integer n and print n factorial.", [("5\n", "120\n"), ("0\n", "1\n")]),
    ("Read n, then n integers; print the largest.", [("3\n4 9 2\n", "9\n"), ("1\n-7\n", "-7\n")]),
    ("Read a word and print YES if it is a palindrome, else NO.", [("level\n", "YES\n"), ("code\n", "NO\n")]),
    ("Read an integer n and print the number of 1 bits in its binary form.", [("7\n", "3\n"), ("8\n", "1\n")]),
]


def dapo_math_source_rows() -> list[dict]:
    """DAPO-Math-17k rows (its parquet's schema): the instruction is already inside the prompt."""
    return [{"data_source": "math_dapo", "prompt": loaders.math_prompt(problem), "ability": "MATH",
             "reward_model": {"ground_truth": answer, "style": "rule-lm"},
             "extra_info": {"index": str(uuid.UUID(int=i))}} for i, (problem, answer) in enumerate(MATH_PROBLEMS)]


def taco_verified_source_rows() -> list[dict]:
    """TACO-Verified rows (BAAI/TACO's schema, every field a string)."""
    return [{"question": question, "solutions": "[]", "starter_code": "", "difficulty": "EASY", "source": "rehearsal",
             "input_output": json.dumps({"inputs": [i for i, _ in tests], "outputs": [o for _, o in tests]})}
            for question, tests in CODE_PROBLEMS]


SOURCES = {"dapo-math.jsonl": dapo_math_source_rows, "taco-verified.jsonl": taco_verified_source_rows}


# ---------------------------------------------------------------------------------------------- tokenizer
def make_tokenizer(tokenizer_len: int, corpus: list[str], special_base: int = SPECIAL_BASE) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `corpus`, padded with placeholders to `tokenizer_len` tokens; ChatML specials
    at the family's ids (special_base..), so every id a model of this family can emit below its length decodes."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(corpus, trainer=trainer)
    state = json.loads(backend.to_str())
    vocab = state["model"]["vocab"]
    specials = {special_base + i: text for i, text in enumerate((ENDOFTEXT, IM_START, IM_END))}
    for index in range(len(vocab), tokenizer_len):
        vocab[specials.get(index, f"<placeholder_{index}>")] = index
    state["added_tokens"] = [  # in the model's vocabulary too, so they keep these ids
        {"id": index, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True} for index, text in specials.items()]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(state)),
                                        eos_token=IM_END, pad_token=ENDOFTEXT)
    tokenizer.chat_template = CHAT_TEMPLATE
    if len(tokenizer) != tokenizer_len:
        raise AssertionError(f"rehearsal tokenizer has {len(tokenizer)} tokens, expected {tokenizer_len}")
    return tokenizer


def _corpus() -> list[str]:
    rows = loaders.dapo_math_rows(dapo_math_source_rows()) + loaders.taco_verified_rows(taco_verified_source_rows())[0]
    return [CHAT_TEMPLATE] + [message["content"] for row in rows for message in row["prompt"]]


# ---------------------------------------------------------------------------------------------- models
def init_model(spec: Preset, seed: int = 0, output_std: float = 0.5, mixing_std: float = 1.5):
    """The stand-in model, in fp32 and eval mode, with random weights shaped like a trained model's output.

    `output_std` (the output embedding's std) sets the logits' spread; `mixing_std` (the attention and MLP
    output projections') makes the layers outweigh the input embedding in the residual stream, which a tied
    embedding otherwise turns into "repeat the last token" (README, "Rehearsal", gives the resulting entropy
    and top-64 mass).
    """
    torch.manual_seed(seed)
    config = spec.config
    model = spec.model_class(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, output_std if config.tie_word_embeddings else 1.0)
        if not config.tie_word_embeddings:
            model.lm_head.weight.normal_(0.0, output_std)
        for layer in model.model.layers:
            mixer = layer.self_attn.o_proj if hasattr(layer, "self_attn") else layer.linear_attn.out_proj
            for proj in (mixer, layer.mlp.down_proj):
                proj.weight.normal_(0.0, mixing_std)
    return model


def build_model(out_dir: Path, spec: Preset, seed: int = 0) -> dict:
    """Write the tiny checkpoint (bf16 safetensors, as the real ones) with its tokenizer into out_dir; returns
    what the build measured of its native head (`train_native_head`), {} for a model without one."""
    config = spec.config
    model = init_model(spec, seed)
    state = {name: t.to(torch.bfloat16).contiguous() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied checkpoints store the embedding once
    tokenizer = make_tokenizer(spec.tokenizer_len, _corpus(), spec.special_base)
    measured = {}
    if spec.native_head:
        served = model.to(torch.bfloat16).float()  # the weights the engine serves, computed in fp32
        head, measured = train_native_head(served, spec, tokenizer, seed=seed + 1)
        family = family_for_backbone(config)
        state.update({n: t.to(torch.bfloat16) for n, t in to_native_state_dict(head.state_dict(), family).items()})
    out_dir.mkdir(parents=True, exist_ok=True)
    config.dtype = "bfloat16"
    config.save_pretrained(out_dir)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out_dir)
    return measured


# The native head's training (native_head.py): the stand-in's samples after the rehearsal's prompts of both
# domains but the last HELD_OUT of each, POOL_ROWS responses each; the held-out prompts measure its tau.
HELD_OUT = 2
POOL_ROWS = 32
DISTILL = dict(steps=40, lr=5e-3, batch=8)
MEASURE_ROWS = 8  # responses per held-out prompt: 32 of 64 tokens, about 1,000 cycles at tau 2


def rehearsal_prompts(tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """(training, held-out) token ids of the rehearsal's prompts, chat-formatted as `--data.apply_chat_template`
    renders them for the run."""
    domains = (loaders.dapo_math_rows(dapo_math_source_rows()),
               loaders.taco_verified_rows(taco_verified_source_rows())[0])
    training, held_out = [], []
    for rows in domains:
        ids = [tokenizer(tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"] for row in rows]
        training += ids[:-HELD_OUT]
        held_out += ids[-HELD_OUT:]
    return training, held_out


def train_native_head(model, spec: Preset, tokenizer, seed: int) -> tuple[MTPHead, dict]:
    """The native head for `model` (native_head.distill), rounded to bf16 as it is stored, and its frozen
    realised tau on the held-out prompts at every depth in spec.rehearsed_depths. Raises WeakNativeHeadError
    where the tau at the first depth is below spec.min_native_tau."""
    config = spec.config
    training, held_out = rehearsal_prompts(tokenizer)
    pool = native_head.sample_pool(model, training, rows=POOL_ROWS, seed=seed)
    head = MTPHead(make_head_config(config, family_for_backbone(config)))
    head = native_head.distill(model, head, pool, seed=seed, **DISTILL)
    head = head.to(torch.bfloat16).float().eval()
    tau = {str(k): native_head.measure_tau(model, head, held_out, MEASURE_ROWS, k, seed=seed)
           for k in spec.rehearsed_depths}
    first = spec.rehearsed_depths[0]
    if spec.min_native_tau is not None and tau[str(first)]["tau"] < spec.min_native_tau:
        raise WeakNativeHeadError(
            f"the native head drafts too little for its stand-in: realised tau {tau[str(first)]['tau']:.3f} at "
            f"K={first} on {len(held_out)} held-out prompts, below the {spec.min_native_tau} this preset needs "
            f"(training: {native_head.__name__}.distill with {DISTILL} on {POOL_ROWS} samples of each of "
            f"{len(training)} prompts)")
    info = {"training": {"prompts": len(training), "rows_per_prompt": POOL_ROWS, **DISTILL},
            "held_out_prompts": len(held_out), "rows_per_held_out_prompt": MEASURE_ROWS, "tau": tau}
    return head, info


def describe(root: str | Path, model: str) -> str:
    """One line on a built world: its version, digest and native head's measured tau per K."""
    info = json.loads((Path(root) / model / "rehearsal.json").read_text())
    line = f"rehearsal world {model} (version {info['version']}): digest {info['digest']}"
    for k, measured in info.get("native_head", {}).get("tau", {}).items():
        line += (f"; native head tau {measured['tau']:.3f} at K={k} (frozen, {measured['cycles']} cycles on "
                 f"{info['native_head']['held_out_prompts']} held-out prompts)")
    return line


def digest(model_dir: str | Path) -> str:
    """sha256 over the checkpoint's tensors (name, dtype, shape, bytes) in name order, as the ablation worlds'
    `World.digest`: two builds hold the same weights exactly when their digests agree."""
    hasher = hashlib.sha256()
    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        hasher.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        hasher.update(tensor.flatten().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()[:16]


def build(root: str | Path, model: str) -> Path:
    """The world for `model` under root (built unless complete): root/<model>/ with its stamp rehearsal.json
    (the world version, the weights' digest, the native head's measured tau), and the raw dataset sources.
    Raises UnsupportedPresetError, before anything is written, for a preset this machine cannot serve, and
    WeakNativeHeadError, with no stamp written, where the native head drafts below the preset's floor."""
    spec = preset(model)
    root = Path(root)
    stamp = root / model / "rehearsal.json"
    if not stamp.exists() or json.loads(stamp.read_text()).get("version") != WORLD_VERSION:
        stamp.unlink(missing_ok=True)  # a build that fails (WeakNativeHeadError) leaves no stamp: the next one retries
        measured = build_model(root / model, spec)
        info = {"version": WORLD_VERSION, "model": model, "digest": digest(root / model)}
        if measured:
            info["native_head"] = measured
        stamp.write_text(json.dumps(info, indent=1) + "\n")
    for name, rows in SOURCES.items():  # a few rows: rewritten every time, so they never go stale
        with (root / name).open("w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows())
    return root

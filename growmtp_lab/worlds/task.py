"""The demo's synthetic reasoning task: multi-digit addition with worked steps, and its checker.

A prompt is the two numbers' digits and `=`; a solution adds column by column from the right, writing
each column's digit sum (with the carry as `+ 1`), then `A` and the answer's digits, then `<eos>`:

    prompt:   3 4 7 + 5 8 9 =
    solution: 7 + 9 = 1 6 , 4 + 8 + 1 = 1 3 , 3 + 5 + 1 = 9 , A 9 3 6 <eos>

Most of a solution is predictable from what came before (digits copied from the prompt, `+`, `=`, `,`),
which is what makes reasoning traces good material for a draft head; the column sums and the answer
are where the policy can go wrong, and the answer is checkable.

A world may also give the solution forking tokens: with `connectives`, each column's step is preceded by
one of those words, drawn uniformly from a seeded rng (the reasoning world's 32 `CONNECTIVES`):

    solution: so 7 + 9 = 1 6 , hence 4 + 8 + 1 = 1 3 , well 3 + 5 + 1 = 9 , A 9 3 6 <eos>

Connectives hold no digit and are never `A`, so the answer is read as without them.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<eos>", "<unk>"]
SYMBOLS = [str(d) for d in range(10)] + ["+", "=", ",", "A"]
PAD_ID, EOS_ID = 0, 1
MARKER = "A"  # what precedes the answer's digits
CONNECTIVES = ("so", "then", "next", "now", "thus", "hence", "therefore", "also", "and", "further", "moreover",
               "again", "meanwhile", "likewise", "similarly", "besides", "consequently", "accordingly", "afterwards",
               "subsequently", "additionally", "indeed", "clearly", "naturally", "certainly", "well", "okay", "right",
               "anyway", "still", "here", "finally")


def vocabulary(size: int, words: Sequence[str] = ()) -> list[str]:
    """The word list, id by id: SPECIAL, SYMBOLS, `words`, then never-used words `w0`, `w1`, ... up to `size`
    ids, so that every id decodes to a word."""
    used = SPECIAL + SYMBOLS + list(words)
    full = used + [f"w{i}" for i in range(size - len(used))]
    if len(full) != size or len(set(full)) != size:
        raise ValueError(f"a vocabulary of {size} words cannot hold {len(used)} distinct ones: {words}")
    return full


VOCAB = vocabulary(32)  # the demo world's


def make_tokenizer(vocab: Sequence[str] = VOCAB) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over `vocab` (id i is vocab[i]): text is whitespace-separated words."""
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(vocab)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def sample_problem(rng: random.Random, min_digits: int, max_digits: int) -> tuple[int, int]:
    digits = rng.randint(min_digits, max_digits)
    low = 10 ** (digits - 1)
    return rng.randint(low, 10 * low - 1), rng.randint(low, 10 * low - 1)


def prompt_text(a: int, b: int) -> str:
    return " ".join(str(a)) + " + " + " ".join(str(b)) + " ="


def solution_text(a: int, b: int, marker: str = MARKER, connectives: Sequence[str] = (),
                  rng: random.Random | None = None) -> str:
    """The worked solution (without `<eos>`); a and b have the same number of digits. With `connectives`, each
    column's step starts with `rng.choice(connectives)` (one draw per column, from the rightmost); without, the
    rng is not drawn from."""
    xs, ys = str(a)[::-1], str(b)[::-1]
    assert len(xs) == len(ys), "operands must have the same number of digits"
    if connectives and rng is None:
        raise ValueError("connectives are drawn from an rng: pass one")
    steps, carry = [], 0
    for x, y in zip(xs, ys):
        column = int(x) + int(y) + carry
        terms = f"{x} + {y}" + (" + 1" if carry else "")
        fork = f"{rng.choice(connectives)} " if connectives else ""
        steps.append(f"{fork}{terms} = {' '.join(str(column))}")
        carry = column // 10
    return " , ".join(steps) + f" , {marker} " + " ".join(str(a + b))


def extract_answer(response: str, marker: str = MARKER) -> int | None:
    """The number after the last `marker`, or None when the response has none."""
    found = re.findall(rf"(?:^|\s){re.escape(marker)}((?:\s*\d)+)", response)
    if not found:
        return None
    return int("".join(found[-1].split()))


def score(response: str, label: str, marker: str = MARKER) -> float:
    """1.0 when the response's answer equals the label (an integer as text), else 0.0."""
    answer = extract_answer(response, marker)
    return float(answer is not None and str(answer) == label.strip())

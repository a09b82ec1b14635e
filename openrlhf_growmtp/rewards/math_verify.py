"""Rule-based checking of a model's final math answer against a reference answer (DAPO-Math-17K style).

Pure Python + sympy. The pipeline is `extract_answer` (find the final answer in a response),
`normalize` (canonical string), then `is_equiv` (string match, then structural and sympy comparison).
`math_score` wraps it all into a 0/1 reward that never raises.

Conventions (what counts as "the same answer"):

* Exact normalized string match always counts.
* Scalars are parsed by `latex_to_sympy`, a small hand-written LaTeX parser, and compared by value:
  exactly when neither side contains a decimal point (rationals by `==`, other constants and symbolic
  expressions by evaluating the difference with sympy's adaptive-precision `evalf`, which yields 30 correct
  digits of a nonzero difference however small, or a value below ~1e-160 for an exact zero; a relative
  difference under 1e-100 counts as zero); with a relative tolerance of 1e-6 when either side is written
  with a decimal point (so `0.5` matches `1/2`, `0.333` does not match `1/3`, `3.14` does not match `\\pi`).
  Expressions with variables are compared at fixed pseudo-random points (positive and negative).
* A trailing percent sign is accepted either as "/100" or as a unit: `50\\%` matches `50` and `0.5`.
* `(a, b, ...)` and `[a, b, ...]`, including intervals such as `[a, b)`, are ordered: same brackets on
  both ends, same length, elementwise equal. `(1, 2)` is ambiguous (point or open interval); both
  readings compare the same way, so it matches another `(1, 2)` and never `[1, 2]`, `(1, 2]` or `1, 2`.
* Unions `A \\cup B` of such pieces are compared as multisets of pieces (order of the pieces is free).
* Sets `\\{a, b\\}` and bare comma lists `a, b` (e.g. solutions `x = 1, 2`) are multisets; a single
  scalar equals a one-element list. Elements named by different variables (`x = 1, y = 2`) keep the names.
* Anything else (matrices, inequalities, text) only matches by normalized string.

Hostile input is contained by size limits (long answers are only string-compared), by refusing huge
powers, factorials, roots and floors of huge numbers while parsing, by never calling `simplify`, by a
cooperative per-comparison deadline checked in the comparison loops (OpenRLHF calls reward functions
from worker threads, where signals cannot be used), and by a SIGALRM limit when in the main thread.
"""

from __future__ import annotations

import contextlib
import functools
import random
import re
import signal
import threading
import time

import sympy

MAX_SYMPY_CHARS = 300  # longer answers are compared as strings only
MAX_ANSWER_CHARS = 2000  # longer answers are not compared at all (beyond identical raw text)
MAX_ITEMS = 32  # elements in a tuple/set/list/union
TIME_LIMIT_S = 1.0  # per is_equiv call
MAX_POWER_BITS = 20_000  # size of an integer power the parser agrees to build
MAX_EXPONENT = 1000
MAX_ROOT_BASE_BITS = 256  # sympy factors the base of a fractional power; keep that cheap
MAX_FACTORIAL = 1000
MAX_ROUNDED = 1e30  # floor/ceiling argument
MAX_DEPTH = 60
LOOSE_REL_TOL = 1e-6
EXACT_REL_TOL = 1e-100  # far below any real difference, far above evalf's "cannot tell from zero" (~1e-160)
ZERO = 1e-100  # a difference this small counts as zero even when both values are (disguised) zeros
DIGITS = 30
N_POINTS = 5

# --------------------------------------------------------------------------------------------------
# Extraction


def _balanced_group(text: str, start: int) -> str | None:
    """Content of the `{...}` group whose opening brace is at `start`, or None when it never closes.

    Backslash-escaped characters (`\\{`, `\\}`) do not count as braces.
    """
    depth = 0
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed`/`\\fbox`; None when there is none or it is truncated/empty."""
    at, name = max((text.rfind("\\" + cmd), cmd) for cmd in ("boxed", "fbox"))
    if at < 0:
        return None
    i = at + len(name) + 1
    while i < len(text) and text[i] in " \t":
        i += 1
    if i < len(text) and text[i] == "{":
        content = _balanced_group(text, i)
    else:
        # `\boxed 5`: TeX takes the next token; in practice it runs to the end of the math or line
        content = re.split(r"[$\n]", text[i:], maxsplit=1)[0]
    content = _strip_decorations(content) if content is not None else None
    return content or None


_SPECIAL_TOKEN = re.compile(r"<\|[A-Za-z0-9_:.\-]{1,40}\|>|</s>|<eos>|<end_of_turn>")
_ANSWER_LINE = re.compile(r"^[ \t>#*_]*(?:final[ \t]+)?answer[ \t*_]*:(.*)$", re.IGNORECASE | re.MULTILINE)
_ANSWER_PREFIX = re.compile(r"^(?:the[ \t]+)?(?:final[ \t]+)?answer[ \t]+is[ \t]*:?", re.IGNORECASE)


def _strip_decorations(s: str) -> str:
    """Remove surrounding whitespace, markdown bold, `$` math delimiters and a trailing period."""
    previous = None
    while s != previous:
        previous = s
        s = s.strip().strip("*").strip()
        if s.endswith("."):
            s = s[:-1]
        if len(s) >= 2 and s.startswith("$") and s.endswith("$"):
            s = s.strip("$")
        if s.startswith("\\(") and s.endswith("\\)") or s.startswith("\\[") and s.endswith("\\]"):
            s = s[2:-2]
    return s


def _last_answer_line(text: str) -> str | None:
    """The content of the last `Answer: ...` line (also `**Answer:**`, `Final Answer:`).

    When the line holds nothing after the colon, the next non-empty line is the answer.
    """
    matches = list(_ANSWER_LINE.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    content = last.group(1)
    if not _strip_decorations(content):
        following = [line for line in text[last.end() :].splitlines() if line.strip()]
        content = following[0] if following else ""
    content = _ANSWER_PREFIX.sub("", _strip_decorations(content))
    content = _strip_decorations(content)
    return content or None


def extract_answer(response: str) -> str | None:
    """The final answer in a model response, or None.

    The last `\\boxed{...}` (or `\\boxed ...`, `\\fbox{...}`) wins; a truncated last box counts as no box.
    Otherwise the last line of the form `Answer: ...` (DAPO's requested format, case-insensitive,
    markdown bold and `Final` allowed) is used, with `$` delimiters and a trailing period removed.
    Chat special tokens (`<|im_end|>`, `<|endoftext|>`, `</s>`, `<eos>`) are treated as line breaks:
    OpenRLHF decodes the sequence with `skip_special_tokens=False`.
    """
    if not isinstance(response, str):
        return None
    response = _SPECIAL_TOKEN.sub("\n", response)
    return _last_boxed(response) or _last_answer_line(response)


# --------------------------------------------------------------------------------------------------
# Normalization

_UNICODE = {
    "\u2212": "-", "\u2013": "-", "\u00d7": "\\times ", "\u00b7": "\\cdot ", "\u03c0": "\\pi ",
    "\u221e": "\\infty ", "\u221a": "\\sqrt", "\u222a": "\\cup ", "\u00b0": "^\\circ", "\u2205": "\\emptyset ",
}
_WRAPPERS = ("text", "textbf", "textit", "textrm", "textnormal", "mbox", "mathrm", "mathbf", "mathit",
             "operatorname", "boldsymbol", "mathbb")
_GREEK = ("alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta", "vartheta",
          "iota", "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "upsilon", "phi", "varphi",
          "chi", "psi", "omega", "Gamma", "Delta", "Theta", "Lambda", "Xi", "Sigma", "Phi", "Psi", "Omega")
_UNITS = ("cm", "mm", "km", "m", "meter", "meters", "metre", "metres", "centimeters", "inch", "inches",
          "in", "ft", "feet", "foot", "yd", "yards", "mi", "miles", "mph", "kg", "g", "grams", "lb", "lbs",
          "pounds", "oz", "s", "sec", "seconds", "min", "minutes", "h", "hr", "hrs", "hours", "days",
          "dollars", "cents", "units", "degrees", "degree", "deg", "sq", "square", "cubic", "l", "ml")
_NOT_UNITS = frozenset({"pi", "e", "i", "sqrt", "or", "and", "infty", "inf"})
_VARIABLE = r"(?:[a-zA-Z]|\\(?:" + "|".join(_GREEK) + r"))(?:_\{?\w+\}?)?(?:\([a-zA-Z]\))?"
_ASSIGNMENT = re.compile(r"^\s*(" + _VARIABLE + r")\s*=\s*")
_NUMBER = r"[+-]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)"
_UNIT_WORD = r"[a-zA-Z]+(?:\s*\^\s*\{?\d\}?)?"
_TRAILING_WORDS = re.compile(r"^(" + _NUMBER + r")(\s*)(" + _UNIT_WORD + r"(?:\s+" + _UNIT_WORD + r")*)\s*$")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def _unwrap_commands(s: str, names: tuple[str, ...]) -> str:
    """Replace `\\name{content}` by `content` for the given command names (content may nest braces)."""
    pattern = re.compile(r"\\(?:" + "|".join(names) + r")\s*(?=\{)")
    while True:
        m = pattern.search(s)
        if not m:
            return s
        content = _balanced_group(s, m.end())
        if content is None:
            return s[: m.start()] + s[m.end() :]
        s = s[: m.start()] + content + s[m.end() + len(content) + 2 :]


def _brace_arguments(s: str, command: str, count: int) -> str:
    """Give every argument of `\\command` braces: `\\frac12` -> `\\frac{1}{2}`, `\\sqrt2` -> `\\sqrt{2}`.

    An unbraced argument is one character or one command (TeX's single token); `\\sqrt[n]` keeps its index.
    """
    out, i, token = [], 0, "\\" + command
    while True:
        at = s.find(token, i)
        if at < 0 or s[at + len(token) : at + len(token) + 1].isalpha():
            if at < 0:
                out.append(s[i:])
                return "".join(out)
            out.append(s[i : at + len(token)])
            i = at + len(token)
            continue
        out.append(s[i : at + len(token)])
        j = at + len(token)
        if command == "sqrt" and s[j : j + 1] == "[":
            close = s.find("]", j)
            if close < 0:
                out.append(s[j:])
                return "".join(out)
            out.append(s[j : close + 1])
            j = close + 1
        for _ in range(count):
            while j < len(s) and s[j] == " ":
                j += 1
            if j >= len(s):
                break
            if s[j] == "{":
                content = _balanced_group(s, j)
                if content is None:
                    break
                out.append("{" + _brace_arguments(content, command, count) + "}")
                j += len(content) + 2
            else:
                m = re.match(r"\\[a-zA-Z]+|\\.|.", s[j:], re.S)
                out.append("{" + m.group(0) + "}")
                j += len(m.group(0))
        i = j


def _strip_units(s: str) -> str:
    """`5 cm` -> `5`, `12 square units` -> `12`, `30degrees` -> `30`; other text is kept."""
    m = _TRAILING_WORDS.match(s)
    if not m:
        return s
    words = re.findall(r"[a-zA-Z]+", m.group(3))
    spaced = bool(m.group(2))
    if any(w.lower() in _NOT_UNITS for w in words):
        return s
    if spaced and all(len(w) >= 2 or w.lower() in _UNITS for w in words) or all(w.lower() in _UNITS for w in words):
        return m.group(1)
    return s


def _strip_assignment(s: str) -> str:
    """Drop a leading `x =` / `\\theta =` / `f(x) =` when it is the only `=` in the answer."""
    m = _ASSIGNMENT.match(s)
    if m and "=" not in s[m.end() :] and not re.search(r"\\[lg]e|[<>]", s):
        return s[m.end() :]
    return s


def _squeeze_spaces(s: str) -> str:
    """Remove whitespace, keeping one space where it separates a command from a following letter."""
    s = re.sub(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])", "\\1\x00", s)
    return re.sub(r"\s+", "", s).replace("\x00", " ")


def _unwrap_whole_box(s: str) -> str:
    """`\\boxed{X}` -> `X` when the box is the whole string (references sometimes come boxed)."""
    for prefix in ("\\boxed{", "\\fbox{"):
        if s.startswith(prefix):
            content = _balanced_group(s, len(prefix) - 1)
            if content is not None and len(content) + len(prefix) + 1 == len(s):
                return content
    return s


def normalize(answer: str) -> str:
    """Canonical string form of an answer (used for exact matching and before parsing).

    Removes `$`, `\\$`, `\\left`/`\\right`, thin spaces (`\\!`, `\\,`, `\\;`, `\\ `), `\\displaystyle`,
    degree marks (`^\\circ`, `^{\\circ}`), text wrappers (`\\text{}`, `\\mbox{}`, `\\mathrm{}`, ... keeping
    their content), unit words trailing a plain number, a leading single variable assignment (`x =`),
    thousands separators in a plain number (`1,000` but not `(1,2)`), a trailing period and whitespace.
    Rewrites `\\dfrac`/`\\tfrac` to `\\frac`, braces unbraced arguments (`\\frac12`, `\\sqrt2`), `.5` to
    `0.5`, `%` to `\\%`, `\\lbrace`/`\\rbrace` to `\\{`/`\\}`, `\\varnothing`/`\\{\\}` to `\\emptyset`,
    a few Unicode symbols to LaTeX, and spaced `or`/`and` between answers to commas.
    """
    s = str(answer).strip()
    s = _unwrap_whole_box(s)
    for char, latex in _UNICODE.items():
        s = s.replace(char, latex)
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\\(?:left|right|big|Big|bigg|Bigg)(?![a-zA-Z])\s*\.?", "", s)
    s = re.sub(r"\\[dtc]frac(?![a-zA-Z])", r"\\frac", s)
    s = re.sub(r"\\(?:displaystyle|textstyle|limits)(?![a-zA-Z])", " ", s)
    s = re.sub(r"\\[!,;:>]", "", s)
    s = re.sub(r"\\ |\\q?quad(?![a-zA-Z])|~", " ", s)
    s = s.replace("\\lbrace", "\\{").replace("\\rbrace", "\\}").replace("{,}", ",")
    s = _unwrap_commands(s, _WRAPPERS)
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ(?![a-zA-Z])", "", s)
    s = re.sub(r"(?<!\\)%", r"\\%", s)
    s = re.sub(r"\\varnothing(?![a-zA-Z])|\\\{\s*\\\}", r"\\emptyset", s)
    s = re.sub(r"\s+(?:or|and)\s+", ", ", s)
    s = _strip_decorations(s)
    s = _strip_assignment(s)
    s = _strip_units(s.strip())
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    s = _squeeze_spaces(s)
    s = _brace_arguments(s, "frac", 2)
    s = _brace_arguments(s, "sqrt", 1)
    s = re.sub(r"(?<![\d.])\.(\d)", r"0.\1", s)
    return s.rstrip(".")


# --------------------------------------------------------------------------------------------------
# LaTeX -> sympy


class _ParseError(Exception):
    pass


_TOKEN = re.compile(
    r"\s*(?:(?P<num>\d+(?:\.\d*)?|\.\d+)"
    r"|(?P<cmd>\\[a-zA-Z]+)"
    r"|(?P<esc>\\[^a-zA-Z])"
    r"|(?P<op>\*\*)"
    r"|(?<![a-zA-Z])(?P<word>sqrt|pi|infinity|infty|sin|cos|tan|ln|log|exp)(?![a-zA-Z])"
    r"|(?P<letter>[a-zA-Z])"
    r"|(?P<char>\S))"
)
_SPACING = frozenset({"\\,", "\\;", "\\!", "\\:", "\\ ", "\\>", "\\displaystyle", "\\quad", "\\qquad",
                      "\\left", "\\right", "\\big", "\\Big", "\\bigg", "\\Bigg"})
_FUNCTIONS = {
    "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "cot": sympy.cot, "sec": sympy.sec,
    "csc": sympy.csc, "arcsin": sympy.asin, "arccos": sympy.acos, "arctan": sympy.atan,
    "sinh": sympy.sinh, "cosh": sympy.cosh, "tanh": sympy.tanh, "ln": sympy.log, "log": sympy.log,
    "exp": sympy.exp,
}
_INVERSES = {"sin": sympy.asin, "cos": sympy.acos, "tan": sympy.atan}
_CONSTANTS = {"pi": sympy.pi, "infty": sympy.oo, "infinity": sympy.oo}
_GROUPING = frozenset({"mathrm", "text", "mathbf", "textbf", "mbox", "operatorname"})
_CLOSERS = {"(": ")", "[": "]", "{": "}"}


def _tokenize(s: str) -> list[tuple[str, str]]:
    """(kind, text) tokens; spacing commands and `\\left`/`\\right` (with a `.` null delimiter) dropped."""
    tokens: list[tuple[str, str]] = []
    pos = 0
    drop_dot = False
    while pos < len(s):
        m = _TOKEN.match(s, pos)
        if not m or m.end() == pos:
            break
        pos = m.end()
        kind = m.lastgroup
        text = m.group(kind)
        if kind == "word":
            kind, text = "cmd", "\\" + text
        if text in _SPACING:
            drop_dot = text in ("\\left", "\\right")
            continue
        if drop_dot and text == ".":
            drop_dot = False
            continue
        drop_dot = False
        tokens.append((kind, text))
    return tokens


def _bits(q: sympy.Rational) -> int:
    return max(int(q.p).bit_length(), int(q.q).bit_length())


def _power(base, exponent):
    """`base ** exponent`, refusing results too large to build or too costly for sympy to simplify."""
    if exponent.is_Number:
        if abs(exponent) > MAX_EXPONENT:
            raise _ParseError("exponent too large")
        if base.is_Rational:
            if base == 0 and exponent.is_negative:
                raise _ParseError("division by zero")
            if exponent.is_Integer and _bits(base) * abs(int(exponent)) > MAX_POWER_BITS:
                raise _ParseError("power too large")
            if not exponent.is_Integer and _bits(base) > MAX_ROOT_BASE_BITS:
                raise _ParseError("root of a huge number")
        elif base.is_number:
            # e.g. sqrt(n)^1000, which sympy turns into the integer n^500
            log2_size = sympy.N(sympy.Abs(sympy.log(sympy.Abs(base), 2)), 15)
            if not log2_size.is_finite or log2_size * abs(exponent) > MAX_POWER_BITS:
                raise _ParseError("power too large")
    elif exponent.is_number:
        magnitude = sympy.N(sympy.Abs(exponent), 15)
        if not magnitude.is_finite or magnitude > MAX_EXPONENT:
            raise _ParseError("exponent too large")
    elif base.is_Rational and _bits(base) > MAX_ROOT_BASE_BITS:
        raise _ParseError("symbolic power of a huge number")
    return sympy.Pow(base, exponent)


def _rounded(value, down: bool):
    """Floor or ceiling of a moderate constant. sympy finds the integer part of a huge value (or of a
    symbolic power at a sample point) by repeated high-precision evaluation, which can take minutes."""
    if value.free_symbols:
        raise _ParseError("floor/ceiling of a symbolic expression")
    magnitude = sympy.N(sympy.Abs(value), 15)
    if not magnitude.is_finite or magnitude > MAX_ROUNDED:
        raise _ParseError("floor/ceiling of a huge number")
    return sympy.floor(value) if down else sympy.ceiling(value)


def _divide(numerator, denominator):
    if denominator == 0:
        raise _ParseError("division by zero")
    return numerator * _power(denominator, sympy.Integer(-1))


class _Parser:
    """Recursive-descent parser over `_tokenize` tokens.

    Grammar (implicit multiplication binds like `*`; `-2^2` is `-(2^2)`):
        expr    := term (('+'|'-') term)*
        term    := signed (('*'|'\\cdot'|'\\times'|'/'|'\\div') signed | power)*
        signed  := ('-'|'+') signed | power
        power   := postfix (('^' exponent) | ('**' signed))*  postfix-ops
        postfix := primary ('!' | '\\%')*
        primary := number ['_' base] | letter ['_' sub] | group | |expr| | command ...
    """

    def __init__(self, tokens: list[tuple[str, str]]):
        self.tokens = tokens
        self.pos = 0
        self.depth = 0
        self.in_abs = 0

    # token helpers
    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def peek_text(self) -> str | None:
        tok = self.peek()
        return tok[1] if tok else None

    def take(self) -> tuple[str, str]:
        tok = self.peek()
        if tok is None:
            raise _ParseError("unexpected end")
        self.pos += 1
        return tok

    def expect(self, text: str) -> None:
        if self.take()[1] != text:
            raise _ParseError(f"expected {text}")

    def parse(self):
        value = self.expr()
        if self.pos != len(self.tokens):
            raise _ParseError("trailing tokens")
        return value

    # grammar
    def expr(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _ParseError("too deep")
        value = self.term()
        while self.peek_text() in ("+", "-"):
            op = self.take()[1]
            right = self.term()
            value = value + right if op == "+" else value - right
        self.depth -= 1
        return value

    def term(self):
        value = self.signed()
        while True:
            text = self.peek_text()
            if text in ("*", "\\cdot", "\\times"):
                self.take()
                value = value * self.signed()
            elif text in ("/", "\\div"):
                self.take()
                value = _divide(value, self.signed())
            elif self.starts_primary():
                if self.peek()[0] == "num" and self.tokens[self.pos - 1][0] == "num":
                    raise _ParseError("two numbers in a row")
                value = value * self.power()
            else:
                return value

    def signed(self):
        text = self.peek_text()
        if text == "-":
            self.take()
            return -self.signed()
        if text == "+":
            self.take()
            return self.signed()
        return self.power()

    def power(self):
        value = self.postfix()
        while self.peek_text() in ("^", "**"):
            op = self.take()[1]
            exponent = self.exponent() if op == "^" else self.signed()
            value = self.postfix_ops(_power(value, exponent))
        return value

    def exponent(self):
        """After `^`: a braced group, or a signed single primary taken whole (`2^10` means 2^{10})."""
        text = self.peek_text()
        if text == "{":
            return self.group()
        if text in ("-", "+"):
            self.take()
            value = self.exponent()
            return -value if text == "-" else value
        return self.primary()

    def postfix(self):
        return self.postfix_ops(self.primary())

    def postfix_ops(self, value):
        while self.peek_text() in ("!", "\\%"):
            if self.take()[1] == "!":
                if not (value.is_Integer and 0 <= value <= MAX_FACTORIAL):
                    raise _ParseError("factorial of a non-integer or huge number")
                value = sympy.factorial(value)
            else:
                value = value / 100
        return value

    def starts_primary(self) -> bool:
        tok = self.peek()
        if tok is None:
            return False
        kind, text = tok
        if kind in ("num", "letter"):
            return True
        if kind == "cmd":
            name = text[1:]
            return (name in _CONSTANTS or name in _FUNCTIONS or name in _GROUPING or name in _GREEK
                    or name in ("frac", "dfrac", "tfrac", "sqrt", "binom", "dbinom", "lfloor", "lceil"))
        if text == "|":
            return not self.in_abs
        return text in ("(", "[", "{")

    def group(self):
        """A bracketed expression; the opening bracket decides the closing one."""
        opener = self.take()[1]
        if opener not in _CLOSERS:
            raise _ParseError("expected a group")
        value = self.expr()
        self.expect(_CLOSERS[opener])
        return value

    def argument(self):
        """A macro argument: a braced group, else a single token (`\\frac12`: the digit `1`, then `2`)."""
        tok = self.peek()
        if tok is None:
            raise _ParseError("missing argument")
        if tok[1] == "{":
            return self.group()
        if tok[0] == "num" and len(tok[1]) > 1:
            self.tokens[self.pos] = ("num", tok[1][1:])
            return sympy.Integer(int(tok[1][0]))
        return self.primary()

    def raw_argument(self) -> str:
        """The source text of a macro argument (for subscripts)."""
        if self.peek_text() != "{":
            kind, text = self.take()
            if kind == "num" and len(text) > 1:
                self.pos -= 1
                self.tokens[self.pos] = ("num", text[1:])
                return text[0]
            return text
        self.take()
        parts = []
        while self.peek_text() != "}":
            parts.append(self.take()[1])
        self.take()
        return "".join(parts)

    def primary(self):
        kind, text = self.take()
        if kind == "num":
            return self.number(text)
        if kind == "letter":
            return self.letter(text)
        if kind == "cmd":
            return self.command(text[1:])
        if text in _CLOSERS:
            self.pos -= 1
            return self.group()
        if text == "|" and not self.in_abs:
            self.in_abs += 1
            value = self.expr()
            self.expect("|")
            self.in_abs -= 1
            return sympy.Abs(value)
        raise _ParseError(f"unexpected {text}")

    def number(self, text: str):
        if self.peek_text() == "_":
            self.take()
            base = self.raw_argument()
            if not (base.isdigit() and 2 <= int(base) <= 36 and text.isdigit()):
                raise _ParseError("bad base subscript")
            try:
                return sympy.Integer(int(text, int(base)))
            except ValueError as exc:
                raise _ParseError("digit out of range for base") from exc
        value = sympy.Rational(text.rstrip(".") or "0")
        fraction = self.proper_fraction_ahead() if text.isdigit() else None
        return value + fraction if fraction is not None else value

    def proper_fraction_ahead(self):
        """Consume `\\frac{p}{q}` with literal digits 0 < p < q right after an integer: a mixed number.

        `2\\frac{1}{2}` is read as 5/2, not 2 * 1/2 (nobody writes the product that way).
        """
        ahead = self.tokens[self.pos : self.pos + 7]
        shape = [(kind, text if kind != "num" else "") for kind, text in ahead]
        if len(ahead) < 7 or shape[0][1] not in ("\\frac", "\\dfrac", "\\tfrac"):
            return None
        if shape[1:] != [("char", "{"), ("num", ""), ("char", "}"), ("char", "{"), ("num", ""), ("char", "}")]:
            return None
        p, q = ahead[2][1], ahead[5][1]
        if not (p.isdigit() and q.isdigit() and 0 < int(p) < int(q)):
            return None
        self.pos += 7
        return sympy.Rational(int(p), int(q))

    def letter(self, name: str):
        if self.peek_text() == "_":
            self.take()
            return sympy.Symbol(f"{name}_{self.raw_argument()}")
        if name == "e":
            return sympy.E
        if name == "i":
            return sympy.I
        return sympy.Symbol(name)

    def command(self, name: str):
        if name in _CONSTANTS:
            return _CONSTANTS[name]
        if name in _GREEK:
            return self.letter(name)
        if name in ("frac", "dfrac", "tfrac"):
            numerator = self.argument()
            return _divide(numerator, self.argument())
        if name == "sqrt":
            index = None
            if self.peek_text() == "[":
                self.take()
                index = self.expr()
                self.expect("]")
            return self.root(self.argument(), index)
        if name in ("binom", "dbinom"):
            n, k = self.argument(), self.argument()
            if any(v.is_number and not (v.is_Integer and abs(v) <= 10 * MAX_FACTORIAL) for v in (n, k)):
                raise _ParseError("binomial of a non-integer or huge number")
            return sympy.binomial(n, k)
        if name in ("lfloor", "lceil"):
            value = self.expr()
            self.expect("\\rfloor" if name == "lfloor" else "\\rceil")
            return _rounded(value, name == "lfloor")
        if name in _GROUPING:
            return self.argument()
        if name in _FUNCTIONS:
            return self.function(name)
        raise _ParseError(f"unknown command {name}")

    def root(self, radicand, index):
        if index is None:
            return _power(radicand, sympy.Rational(1, 2))
        if not (index.is_Integer and 2 <= index <= MAX_EXPONENT):
            raise _ParseError("bad root index")
        if radicand.is_Rational and radicand < 0 and index % 2 == 1:
            return -_power(-radicand, sympy.Rational(1, int(index)))  # real odd root
        return _power(radicand, sympy.Rational(1, int(index)))

    def function(self, name: str):
        base = None
        if name == "log" and self.peek_text() == "_":
            self.take()
            base = self.argument()
        exponent = None
        if self.peek_text() == "^":
            self.take()
            exponent = self.exponent()
        if self.peek_text() == "(":
            argument = self.group()
        else:
            argument = self.power()
        if exponent is not None and exponent == -1 and name in _INVERSES:
            return _INVERSES[name](argument)
        value = sympy.log(argument, base) if base is not None else _FUNCTIONS[name](argument)
        return _power(value, exponent) if exponent is not None else value


@functools.lru_cache(maxsize=4096)
def _parse_cached(s: str):
    try:
        tokens = _tokenize(s)
        if not tokens:
            return None
        return _Parser(tokens).parse()
    except Exception:  # any parser or sympy failure means "not parseable"; _Timeout is not an Exception
        return None


def latex_to_sympy(s: str):
    """A sympy expression for a LaTeX (or plain) math string, or None when it cannot be parsed.

    Supports integers, decimals (as exact rationals), `\\frac{a}{b}` (`\\dfrac`, `\\tfrac`, `\\frac12`),
    `\\sqrt{x}`, `\\sqrt[n]{x}` (real root for odd n), `^` and `**`, `\\cdot`, `\\times`, `\\div`, `/`,
    implicit multiplication (`2\\pi`, `3\\sqrt{2}`, `2(x+1)`), unary signs, `\\pi`, `e`, `i` (imaginary unit),
    `\\infty`, `()`/`[]`/`{}` grouping, `|x|`, `\\lfloor`/`\\lceil`, `!`, `\\binom`, `\\%` (as /100), common
    functions (`\\sin`, `\\log_b`, `\\ln`, `\\sin^2`, `\\sin^{-1}`), Greek letters and other letters as
    symbols; an integer directly followed by a proper digit fraction is a mixed number (`2\\frac{1}{2}` = 5/2).
    Subscripts are only accepted where they are unambiguous: a base on digits (`1010_2` = 10),
    a variable index (`x_1` is its own symbol) and a logarithm base; anything else is unparseable.
    Powers, roots and factorials whose evaluation would be huge are refused (None).
    """
    if not isinstance(s, str) or len(s) > MAX_SYMPY_CHARS:
        return None
    return _parse_cached(s)


# --------------------------------------------------------------------------------------------------
# Equivalence


class _Timeout(BaseException):
    """A comparison ran out of time; a BaseException so sympy's own `except Exception` cannot swallow it."""


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Interrupt the body after `seconds` when that is possible without disturbing the host process.

    Signals only reach the main thread, and an installed SIGALRM handler or a running timer belongs to
    someone else; in those cases only the cooperative deadline and the parser's size limits apply.
    """
    usable = (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None)
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    )
    if not usable:
        yield
        return

    def on_alarm(signum, frame):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_deadline = threading.local()


def _check_deadline() -> None:
    """Cooperative time limit for the comparison loops (works in any thread, unlike SIGALRM)."""
    at = getattr(_deadline, "at", None)
    if at is not None and time.monotonic() > at:
        raise _Timeout()


def _has_decimal(s: str) -> bool:
    return re.search(r"\d\.\d", s) is not None


def _sample_points(symbols) -> list[dict]:
    """Fixed pseudo-random rational points (both signs) for comparing expressions with variables."""
    ordered = sorted(symbols, key=lambda sym: sym.name)
    points = []
    for trial in range(N_POINTS):
        rng = random.Random(7919 * (trial + 1))
        points.append({sym: sympy.Rational(rng.choice((-1, 1)) * rng.randint(50, 400), 97) for sym in ordered})
    return points


def _close_at(a, b, subs: dict, rel: float) -> bool | None:
    """Whether a and b agree at `subs` within `rel`; None when either is undefined or infinite there."""
    va = a.evalf(DIGITS, subs=subs)
    vb = b.evalf(DIGITS, subs=subs)
    bad = (sympy.nan, sympy.zoo, sympy.oo, -sympy.oo)
    if not (va.is_number and vb.is_number) or va.has(*bad) or vb.has(*bad):
        return None
    diff = abs((a - b).evalf(DIGITS, subs=subs))  # evalf of the difference keeps accuracy under cancellation
    scale = max(abs(va), abs(vb))
    if not diff.is_number:
        return None
    return bool(diff <= rel * scale or diff <= ZERO)


def _sympy_equal(a, b, loose: bool) -> bool:
    """Value equality of two parsed expressions (see the module docstring for the tolerances)."""
    if a.has(sympy.nan, sympy.zoo) or b.has(sympy.nan, sympy.zoo):
        return False
    if a.has(sympy.oo, -sympy.oo) or b.has(sympy.oo, -sympy.oo):
        return a == b
    if a.is_Rational and b.is_Rational and not loose:
        return a == b
    rel = LOOSE_REL_TOL if loose else EXACT_REL_TOL
    symbols = a.free_symbols | b.free_symbols
    if not symbols:
        return bool(_close_at(a, b, {}, rel))
    if len(symbols) > 8:
        return False
    agreed = 0
    for point in _sample_points(symbols):
        _check_deadline()
        verdict = _close_at(a, b, point, rel)
        if verdict is False:
            return False
        agreed += verdict is True
    return agreed >= 3


def _percent_variants(s: str) -> list[str]:
    """`50\\%` may mean 0.5 (parsed) or 50 (the percent as a unit); both readings are tried."""
    return [s, s[:-2]] if s.endswith("\\%") and len(s) > 2 else [s]


def _scalars_equal(a: str, b: str) -> bool:
    if a == b:
        return True
    _check_deadline()
    for va in _percent_variants(a):
        for vb in _percent_variants(b):
            if va == vb:
                return True
            ea, eb = latex_to_sympy(va), latex_to_sympy(vb)
            if ea is not None and eb is not None and _sympy_equal(ea, eb, _has_decimal(va) or _has_decimal(vb)):
                return True
    return False


def _split_top(s: str, sep: str) -> list[str]:
    """Split at `sep` where no bracket is open (`(`, `[`, `{` open; `)`, `]`, `}` close, in any pairing)."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        ch = s[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and s.startswith(sep, i) and not (sep[-1].isalpha() and s[i + len(sep) :][:1].isalpha()):
            parts.append(s[start:i])
            i += len(sep)
            start = i
            continue
        i += 1
    parts.append(s[start:])
    return parts


def _encloses(s: str, open_len: int, close_len: int) -> bool:
    """Whether the bracket opening at 0 is closed only by the last `close_len` characters."""
    depth = 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0 and i < len(s) - 1:
                return False
    return depth == 0 and len(s) >= open_len + close_len


def _piece(s: str):
    """`(a, b)`, `[a, b)`, `(a, b, c)` ... as (left bracket, items, right bracket), else None."""
    if len(s) < 2 or s[0] not in "([" or s[-1] not in ")]" or not _encloses(s, 1, 1):
        return None
    items = tuple(_split_top(s[1:-1], ","))
    if len(items) < 2 or len(items) > MAX_ITEMS:
        return None
    return (s[0], items, s[-1])


def _structure(s: str):
    """Classify a normalized answer: ("union", pieces) | ("bag", items) | ("scalar", text)."""
    parts = _split_top(s, "\\cup")
    if len(parts) > 1:
        pieces = [_piece(p) for p in parts]
        if len(pieces) <= MAX_ITEMS and all(pieces):
            return ("union", tuple(pieces))
        return ("scalar", s)
    piece = _piece(s)
    if piece:
        return ("union", (piece,))
    if s == "\\emptyset":
        return ("bag", ())
    if s.startswith("\\{") and s.endswith("\\}") and _encloses(s[1:], 1, 2):
        items = tuple(_split_top(s[2:-2], ","))
        return ("bag", items) if len(items) <= MAX_ITEMS else ("scalar", s)
    items = tuple(_split_top(s, ","))
    if 1 < len(items) <= MAX_ITEMS:
        return ("bag", items)
    return ("scalar", s)


def _named(items: tuple[str, ...]) -> list[tuple[str | None, str]]:
    """(variable, value) per item. One shared variable (`x=1, x=2`) is dropped: it is a solution list."""
    pairs = []
    for item in items:
        m = _ASSIGNMENT.match(item)
        pairs.append((m.group(1), item[m.end() :]) if m and "=" not in item[m.end() :] else (None, item))
    names = {name for name, _ in pairs}
    if len(names) == 1:
        return [(None, value) for _, value in pairs]
    return pairs


def _matched(left: list, right: list, same) -> bool:
    """Multiset equality under `same` (greedy matching; `same` is an equivalence in practice)."""
    if len(left) != len(right):
        return False
    unused = list(right)
    for item in left:
        for j, candidate in enumerate(unused):
            if same(item, candidate):
                del unused[j]
                break
        else:
            return False
    return True


def _pieces_equal(p, q) -> bool:
    return (p[0] == q[0] and p[2] == q[2] and len(p[1]) == len(q[1])
            and all(_scalars_equal(a, b) for a, b in zip(p[1], q[1])))


def _structures_equal(p, r) -> bool:
    if p[0] == "scalar" and r[0] == "bag" and len(r[1]) == 1:
        p = ("bag", (p[1],))
    if r[0] == "scalar" and p[0] == "bag" and len(p[1]) == 1:
        r = ("bag", (r[1],))
    if p[0] != r[0]:
        return False
    if p[0] == "scalar":
        return _scalars_equal(p[1], r[1])
    if p[0] == "union":
        return _matched(list(p[1]), list(r[1]), _pieces_equal)
    return _matched(_named(p[1]), _named(r[1]), lambda a, b: a[0] == b[0] and _scalars_equal(a[1], b[1]))


def _equiv(pred: str, ref: str) -> bool:
    if pred.strip() == ref.strip():
        return bool(pred.strip())
    if len(pred) > MAX_ANSWER_CHARS or len(ref) > MAX_ANSWER_CHARS:
        return False
    p, r = normalize(pred), normalize(ref)
    if not p or not r:
        return False
    if p == r:
        return True
    return _structures_equal(_structure(p), _structure(r))


def is_equiv(pred: str, ref: str) -> bool:
    """Whether a predicted answer matches the reference answer (conventions in the module docstring).

    Never raises; a comparison that errors or runs past `TIME_LIMIT_S` counts as not equal. The limit is
    checked between element comparisons and sample points in every thread, and additionally enforced by
    SIGALRM in the main thread; single sympy operations are kept short by the parser's size limits.
    """
    if not isinstance(pred, str) or not isinstance(ref, str):
        return False
    _deadline.at = time.monotonic() + TIME_LIMIT_S
    try:
        with _time_limit(TIME_LIMIT_S):
            return _equiv(pred, ref)
    except (Exception, _Timeout):
        return False
    finally:
        _deadline.at = None


def math_score(response: str, reference: str) -> float:
    """1.0 when the response's final answer (`extract_answer`) matches `reference`, else 0.0. Never raises."""
    try:
        answer = extract_answer(response)
        if answer is None:
            return 0.0
        return 1.0 if is_equiv(answer, str(reference)) else 0.0
    except Exception:
        return 0.0

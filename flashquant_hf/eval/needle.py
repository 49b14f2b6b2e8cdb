"""The pass-key retrieval prompt: a needle (a random number) at a chosen depth inside repeated filler text.

The prompt is one chat turn, cut in two chunks that reach the model separately:

* the context, prefilled as one chunk: the chat header, an instruction, and the haystack with the needle;
* the question, fed later (as a second turn would be): the end of the user turn and the start of the answer,
  ``The pass key is``. The model then generates the number.

A compressed cache attends its first prefill with exact K/V, so only tokens after that prefill see the
compressed needle: a question prefilled together with the haystack would measure nothing.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from .errors import EvalInputError

KEY_DIGITS = 5
INSTRUCTION = (
    "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key.\n\n"
)
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\n\nWhat is the pass key? Answer with the number only."
ANSWER_PREFIX = "The pass key is"
# Cuts the rendered chat turn where the haystack goes; never produced by a tokenizer's template.
_MARK = "\x00HAYSTACK\x00"
# Generated tokens: a space, the digits, and room for one token more that ends the number.
ANSWER_TOKENS = KEY_DIGITS + 3


@dataclass(frozen=True)
class PromptParts:
    """The fixed token pieces of every prompt, tokenized once per tokenizer.

    ``head`` opens the chat turn and holds the instruction; ``unit`` is one filler sentence group (repeated);
    ``tail`` closes the user turn with the question and opens the answer.
    """

    head: tuple[int, ...]
    unit: tuple[int, ...]
    tail: tuple[int, ...]
    chat_template: bool

    def needle(self, tokenizer, key: str) -> tuple[int, ...]:
        """Token ids of the needle sentence for ``key``."""
        return tuple(tokenizer(NEEDLE.format(key=key), add_special_tokens=False).input_ids)


@dataclass(frozen=True)
class NeedlePrompt:
    """One trial's prompt.

    ``context`` is prefilled as one chunk, ``question`` is fed after it; ``needle_start`` / ``needle_end`` index
    the needle's tokens in ``context`` and ``haystack_start`` / ``haystack_end`` the haystack's (needle included).
    """

    key: str
    context: tuple[int, ...]
    question: tuple[int, ...]
    needle_start: int
    needle_end: int
    haystack_start: int
    haystack_end: int

    @property
    def depth(self) -> float:
        """Where the needle starts, as a fraction of the filler around it (0: first, 1: last)."""
        filler = (self.haystack_end - self.haystack_start) - (self.needle_end - self.needle_start)
        return (self.needle_start - self.haystack_start) / filler if filler else 0.0

    @property
    def prompt_tokens(self) -> int:
        """Context and question together."""
        return len(self.context) + len(self.question)


def _ids(tokenizer, text: str, special: bool = False) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=special).input_ids)


def prompt_parts(tokenizer) -> PromptParts:
    """The chat header, the filler unit and the question, in the tokenizer's chat template when it has one."""
    content = INSTRUCTION + _MARK + QUESTION
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        if rendered.count(_MARK) != 1:
            raise EvalInputError("the tokenizer's chat template does not keep the user message in one piece")
        head, tail = rendered.split(_MARK)
        head_ids, tail_ids, chat = _ids(tokenizer, head), _ids(tokenizer, tail + ANSWER_PREFIX), True
    else:
        head, tail = content.split(_MARK)
        head_ids, chat = _ids(tokenizer, head, special=True), False
        tail_ids = _ids(tokenizer, tail + " " + ANSWER_PREFIX)
    return PromptParts(head_ids, _ids(tokenizer, FILLER), tail_ids, chat)


def pass_key(seed: int, length: int, depth: float, index: int) -> str:
    """A random ``KEY_DIGITS``-digit number, fixed by (seed, length, depth, index) alone."""
    rng = random.Random(f"passkey:{seed}:{length}:{depth:.6f}:{index}")
    return str(rng.randrange(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS))


def filler_units(parts: PromptParts, needle_tokens: int, length: int) -> int:
    """How many filler units fit so that context + question + the generated answer take <= ``length`` tokens."""
    fixed = len(parts.head) + needle_tokens + len(parts.tail) + ANSWER_TOKENS
    units = (length - fixed) // len(parts.unit)
    if units < 1:
        raise EvalInputError(
            f"a length of {length} tokens leaves no room for filler: the instruction, needle, question and "
            f"answer take {fixed} tokens and one filler unit {len(parts.unit)}"
        )
    return units


def build_prompt(tokenizer, parts: PromptParts, length: int, depth: float, key: str) -> NeedlePrompt:
    """The prompt of ``length`` tokens at most (answer included) with the needle after ``depth`` of the filler.

    The needle goes between two filler units, so its depth is exact to one unit (20-odd tokens).
    """
    if not 0.0 <= depth <= 1.0:
        raise EvalInputError(f"a needle depth must be in [0, 1], got {depth}")
    needle = parts.needle(tokenizer, key)
    units = filler_units(parts, len(needle), length)
    before = round(depth * units)
    start = len(parts.head)
    needle_start = start + before * len(parts.unit)
    context = parts.head + parts.unit * before + needle + parts.unit * (units - before)
    return NeedlePrompt(
        key=key,
        context=context,
        question=parts.tail,
        needle_start=needle_start,
        needle_end=needle_start + len(needle),
        haystack_start=start,
        haystack_end=len(context),
    )


def answer_number(text: str) -> str | None:
    """The first run of digits in a generated answer (None when it has none)."""
    match = re.search(r"\d+", text)
    return match.group(0) if match else None


def is_correct(text: str, key: str) -> bool:
    """Exact match: the answer's first number is the key (``"68421."`` yes, ``"6842"`` or ``"684210"`` no)."""
    return answer_number(text) == key

"""GSM8K and math data: prompts in raw or chat form, the final answer after '####' or in \\boxed{}, reward by
math-verify.

Data comes from GSM8K-format data on disk (kind 'gsm8k': {"question", "answer": "... #### N"}, e.g. the official
train split, as JSONL, JSON, parquet or a save_to_disk folder: tasks/dataset_files.py), from any math dataset on disk
whose answer column is the final answer or a solution ending in one (kind 'math': MATH, verl's and TRL's
parquet files, with `dataset.fields` naming the columns), or from a seeded generator of GSM8K-style word
problems (kind 'gsm8k_synth': two- and three-step arithmetic stories with worked solutions; kind 'gsm8k_easy':
one-step stories a small model learns on a CPU; nothing to download, every seed a different stream).

Prompt wording depends on the task's prompt format (TaskSpec.prompt.format):
- raw: 'Q: <question>\\nA:' (a base model continues the text);
- chat: the question and the usual instruction for the answer form (`dataset.answer_format`) as the user
  message; the tokenizer's chat template frames it (model/codec.py TextCodec).
A prompt column that holds chat messages (verl's schema) is used as it is, its own instruction included.

`dataset.answer_format` is also the reward variant: 'hash' scores only an answer after the last '####',
'boxed' only one in the last \\boxed{...}; None (default) takes the '####' answer, else the boxed one, else the
whole completion (lenient, for base models in raw form).
"""
from __future__ import annotations

import logging
import random
import threading

from marlaas_hpc.tasks.base import Sample
from marlaas_hpc.tasks.spec import DatasetSpec, SpecError
INSTRUCTIONS = {
    None: "Solve the problem step by step. Give the final answer as a number after '####' or within \\boxed{}.",
    "hash": "Solve the problem step by step. At the end, write '####' followed by the final answer as a number.",
    "boxed": "Please reason step by step, and put your final answer within \\boxed{}.",
}


def gsm8k_gold(answer: str) -> str:
    """The final answer of a GSM8K solution: the text after '####'."""
    return answer.split("####")[-1].strip().replace(",", "")


def gsm8k_prompt(question: str, prompt_format: str, answer_format: str | None, hint: str = "") -> str:
    """The prompt text of a question: raw 'Q:/A:' framing, or a chat user message with the instruction."""
    if prompt_format == "raw":
        return f"Q: {question}{hint}\nA:"
    return f"{question}{hint}\n{INSTRUCTIONS[answer_format]}"


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (nested braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None


def final_answer(completion: str, answer_format: str | None) -> str | None:
    """The part of a completion that is scored, or None when the asked-for form is missing."""
    hashed = completion.split("####")[-1] if "####" in completion else None
    if answer_format == "hash":
        return hashed
    boxed = last_boxed(completion)
    if answer_format == "boxed":
        return boxed
    if hashed is not None:
        return hashed
    return boxed if boxed is not None else completion


def math_verify_reward(gold: str, completion: str, answer_format: str | None = None) -> float:
    """1.0 if the completion's final answer equals `gold` by math-verify, else 0.0.

    math-verify's own timeouts use SIGALRM, which only works on the main thread; elsewhere they are off and
    the env pool's per-call timeout bounds the call instead (so its warning that they are off is dropped)."""
    from math_verify import parse, verify

    answer = final_answer(completion, answer_format)
    if answer is None:
        return 0.0
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(gold, parsing_timeout=timeout)
    if not gold_parsed:
        return 0.0
    return 1.0 if verify(gold_parsed, parse(answer, parsing_timeout=timeout), timeout_seconds=timeout) else 0.0


class _DropTimeoutOff(logging.Filter):
    """math-verify warns once per process that its timeouts are off (None off the main thread): they are off on
    purpose there, bounded by the env pool instead, and the line was the one stray warning of a GSM8K job."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):  # once, at import (a logger exists before its module)
    logging.getLogger(_name).addFilter(_DropTimeoutOff())


# ---------------------------------------------------------------------------------------------- synthetic
_NAMES = ("Natalia", "James", "Maria", "Tom", "Anna", "Leo", "Mia", "Ben", "Sara", "Omar", "Lena", "Ravi")
_ITEMS = ("apples", "marbles", "pencils", "cookies", "stickers", "books", "eggs", "tickets")


def _story(rng: random.Random) -> tuple[str, str, int]:
    """(question, worked solution, final answer) of one GSM8K-style two- or three-step problem."""
    name, friend = rng.sample(_NAMES, 2)
    items = rng.choice(_ITEMS)
    kind = rng.randrange(6)
    if kind == 0:
        a, b = rng.randint(12, 90), rng.randint(3, 40)
        c = rng.randint(1, a + b - 1)
        r = a + b - c
        return (f"{name} has {a} {items}. {name} buys {b} more and then gives {c} to {friend}. "
                f"How many {items} does {name} have now?",
                f"After buying, {name} has {a} + {b} = {a + b} {items}. After giving {c} away, "
                f"{a + b} - {c} = {r}.", r)
    if kind == 1:
        a = 2 * rng.randint(6, 60)
        r = a + a // 2
        return (f"{name} sold {a} {items} in April, and then sold half as many {items} in May. "
                f"How many {items} did {name} sell altogether in April and May?",
                f"In May {name} sold {a} / 2 = {a // 2}. Altogether {a} + {a // 2} = {r}.", r)
    if kind == 2:
        a, b = rng.randint(4, 24), rng.randint(2, 9)
        c = rng.randint(1, a * b - 1)
        r = a * b - c
        return (f"A box holds {a} {items}. {name} fills {b} boxes and then uses {c} {items}. "
                f"How many {items} are left?",
                f"{b} boxes hold {b} * {a} = {a * b}. After using {c}, {a * b} - {c} = {r} are left.", r)
    if kind == 3:
        a, b, c = rng.randint(8, 30), rng.randint(2, 9), rng.randint(2, 6)
        r = a * b * c
        return (f"{name} earns ${a} per hour, works {b} hours a day and works {c} days. "
                f"How many dollars does {name} earn?",
                f"Per day {name} earns {a} * {b} = {a * b}. In {c} days, {a * b} * {c} = {r}.", r)
    if kind == 4:
        a, c = rng.randint(5, 40), rng.randint(2, 7)
        b = a * c + rng.randint(1, 200)
        r = b - a * c
        return (f"{name} reads {a} pages a day. The book has {b} pages. "
                f"How many pages are left to read after {c} days?",
                f"In {c} days {name} reads {a} * {c} = {a * c} pages. {b} - {a * c} = {r} are left.", r)
    a, b = rng.randint(3, 12), rng.randint(2, 15)
    c = a * b + rng.randint(1, 50)
    r = c - a * b
    return (f"{name} buys {a} {items} at ${b} each and pays with ${c}. How many dollars of change does "
            f"{name} get?", f"The {items} cost {a} * {b} = {a * b}. The change is {c} - {a * b} = {r}.", r)


def synthetic_gsm8k(rng: random.Random) -> tuple[str, str, dict]:
    """A GSM8K-format (question, final answer, meta) from the generator; meta holds the worked solution."""
    question, solution, result = _story(rng)
    return question, str(result), {"solution": f"{solution}\n#### {result}"}


_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def one_step_gsm8k(rng: random.Random) -> tuple[str, str, dict]:
    """A one-step GSM8K-style problem (a count in digits plus one in words: 'has 7 apples and buys five more'),
    its answer, and meta: the terms, the worked solution and the systematic mistake of forgetting the carry
    ('7 + 5 = 2'), which agrees with the answer when the sum stays below ten (a third of the problems). A model
    of a few million parameters learns these on a CPU (model/chat_mini.py)."""
    name, items = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    more = _NUMBER_WORDS[b]
    question = (f"{name} has {a} {items} and buys {more} more. How many {items} does {name} have now?",
                f"{name} had {a} {items} and found {more} more. How many {items} does {name} have?",
                f"A box holds {a} {items}. {name} puts {more} more in it. How many {items} are in the box now?",
                )[rng.randrange(3)]
    return question, str(a + b), {"solution": f"{a} + {b} = {a + b}.\n#### {a + b}", "mistake": str((a + b) % 10),
                                  "terms": [a, b]}


def gsm8k_sample(index: int, question: str, gold: str, meta: dict, prompt_format: str,
                 answer_format: str | None, hint: str = "") -> Sample:
    return Sample(index, gsm8k_prompt(question, prompt_format, answer_format, hint), gold,
                  {**meta, "question": question})


class Gsm8kTask:
    """Mixin of the GSM8K task classes: score by math-verify in the spec's answer format."""

    answer_format: str | None = None

    def score(self, sample: Sample, completion: str) -> float:
        return math_verify_reward(sample.answer, completion, self.answer_format)

    def warm_up(self) -> None:
        """Imports math-verify / sympy / latex2sympy (seconds) before the first timed reward."""
        math_verify_reward("1", "1")


GSM8K_FIELDS = {"prompt": "question", "answer": "answer"}
"""Columns of GSM8K-format data (openai/gsm8k): the question and a worked solution ending in '#### N'."""
MATH_FIELDS = {"prompt": "problem", "answer": "answer"}
"""Default columns of a math dataset (MATH-500 and the like); verl's parquet: {prompt: prompt, answer:
reward_model.ground_truth}."""


def gsm8k_file_samples(spec: DatasetSpec, prompt_format: str, hint: str = "") -> list[Sample]:
    """The samples of GSM8K-format data (tasks/dataset_files.py: any format, `dataset.fields`); a record whose answer
    has no '#### N' is refused by where it is."""
    samples = []
    for record in _records(spec, GSM8K_FIELDS, prompt_format, hint):
        if "####" not in record.answer:
            raise SpecError("dataset.path", f"{record.where}: answer has no '#### N' final answer (GSM8K format; "
                                            "kind 'math' takes a bare final answer or a \\boxed{} one)")
        samples.append(_file_sample(len(samples), record, gsm8k_gold(record.answer), {"solution": record.answer},
                                    prompt_format, spec.answer_format, hint))
    return samples


def math_file_samples(spec: DatasetSpec, prompt_format: str) -> list[Sample]:
    """The samples of a math dataset: the answer column is the final answer, or a solution whose final answer
    follows the last '####' or sits in the last \\boxed{}."""
    return [_file_sample(i, record, math_gold(record.answer), {"solution": record.answer, **record.extra},
                         prompt_format, spec.answer_format) for i, record in
            enumerate(_records(spec, MATH_FIELDS, prompt_format))]


def math_gold(answer: str) -> str:
    """The final answer of a math answer column: after '####', else in the last \\boxed{}, else all of it."""
    if "####" in answer:
        return gsm8k_gold(answer)
    boxed = last_boxed(answer)
    return (boxed if boxed is not None else answer).strip()


def _records(spec: DatasetSpec, defaults: dict[str, str], prompt_format: str, hint: str = ""):
    from marlaas_hpc.tasks.dataset_files import read_records

    records = read_records(spec.path, spec.fields, defaults, spec.split)
    check_message_prompts(records, prompt_format)
    if hint and not isinstance(records[0].prompt, str):
        raise SpecError("dataset.fields", f"{records[0].where}: tool workloads append their hint to text prompts; "
                                          "this prompt column holds chat messages")
    return records


def check_message_prompts(records, prompt_format: str) -> None:
    """Chat-message prompts are rendered by the chat template: they need `prompt.format: chat`."""
    message = next((r for r in records if not isinstance(r.prompt, str)), None)
    if message is not None and prompt_format != "chat":
        raise SpecError("prompt.format", f"{message.where}: the prompt is chat messages, which need "
                                         "prompt.format: chat (the tokenizer's chat template renders them)")


def _file_sample(index: int, record, gold: str, meta: dict, prompt_format: str, answer_format: str | None,
                 hint: str = "") -> Sample:
    """A record as a sample: a text prompt worded for the prompt format (gsm8k_prompt), messages as they are."""
    if not isinstance(record.prompt, str):
        return Sample(index, record.prompt, gold, meta)
    return gsm8k_sample(index, record.prompt, gold, meta, prompt_format, answer_format, hint)

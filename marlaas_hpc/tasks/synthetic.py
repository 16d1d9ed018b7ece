"""Synthetic verifiable tasks the tiny model can learn on two CPU cores.

Each generator also returns a plausible systematic mistake (addition without carries, reversal that only
swaps the ends, counting in the first four letters, sorting all but the last digit). It agrees with the
right answer on part of the inputs. The tiny model is pre-trained on a mix of right and mistaken answers,
so it starts as a policy that is sometimes right and can be taught the right rule by reward alone.

Each prompt ends with '=' and the answer follows directly, then end-of-sequence. Train and eval splits are
drawn from one seeded generator; eval prompts never appear in the train stream.
"""
from __future__ import annotations

import math
import random
import string

from marlaas_hpc.tasks.base import Sample, TaskData
from marlaas_hpc.tasks.gsm8k import Gsm8kTask, gsm8k_sample, one_step_gsm8k, synthetic_gsm8k
from marlaas_hpc.tasks.spec import DatasetSpec

_LETTERS = "abcdef"


def _addition(rng: random.Random) -> tuple[str, str, str]:
    # two digits plus one: small enough for the tiny model; the mistake forgets the carry into the tens
    a, b = rng.randint(10, 99), rng.randint(2, 9)
    no_carry = (a // 10) * 10 + (a % 10 + b) % 10
    return f"{a}+{b}=", str(a + b), str(no_carry)


def _reverse(rng: random.Random) -> tuple[str, str, str]:
    word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 5)))
    return f"rev {word}=", word[::-1], word[-1] + word[1:-1] + word[0]


def _count(rng: random.Random) -> tuple[str, str, str]:
    letter = rng.choice("ab")
    word = "".join(rng.choice("abc") for _ in range(rng.randint(4, 8)))
    return f"cnt {letter}:{word}=", str(word.count(letter)), str(word[:4].count(letter))


def _sort(rng: random.Random) -> tuple[str, str, str]:
    digits = "".join(rng.choice(string.digits) for _ in range(rng.randint(3, 5)))
    return f"srt {digits}=", "".join(sorted(digits)), "".join(sorted(digits[:-1])) + digits[-1]


GENERATORS = {"addition": _addition, "reverse": _reverse, "count": _count, "sort": _sort}


class _WithMistake:
    """A kind's generator as (prompt, answer, {'mistake': ...}) (a class, not a closure: tasks must pickle for
    process pools)."""

    def __init__(self, kind: str):
        self.kind = kind

    def __call__(self, rng: random.Random) -> tuple[str, str, dict]:
        prompt, answer, mistake = GENERATORS[self.kind](rng)
        return prompt, answer, {"mistake": mistake}


class SyntheticTask(TaskData):
    """A generated task: exact-match reward on the stripped completion. `make(rng)` draws one
    (prompt, answer, meta); by default the kind's generator (meta: its systematic mistake)."""

    def __init__(self, spec: DatasetSpec, make=None):
        self.kind = spec.kind
        self._make = make or _WithMistake(spec.kind)
        self._seed = spec.seed
        rng = random.Random(f"{spec.kind}-eval-{spec.seed}")
        self._eval: list[Sample] = []
        seen: set[str] = set()
        for _ in range(spec.eval_size * 20):
            if len(self._eval) == spec.eval_size:
                break
            prompt, answer, meta = self._make(rng)
            if prompt not in seen:
                seen.add(prompt)
                self._eval.append(Sample(len(self._eval), prompt, answer, meta))
        self._eval_prompts = frozenset(seen)

    def train_sample(self, cursor: int) -> Sample:
        rng = random.Random(f"{self.kind}-train-{self._seed}-{cursor}")
        while True:
            prompt, answer, meta = self._make(rng)
            if prompt not in self._eval_prompts:
                return Sample(cursor, prompt, answer, meta)

    def eval_samples(self) -> list[Sample]:
        return list(self._eval)

    def score(self, sample: Sample, completion: str) -> float:
        return 1.0 if completion.strip() == sample.answer else 0.0


LONG_TAIL_MEDIAN = 8
"""Median completion length (tokens) of the `long_tail` kind."""
LONG_TAIL_SIGMA = 0.99
"""Log-normal sigma of the `long_tail` kind's lengths: p99 = exp(2.326 sigma) = 10x the median (p90 3.6x)."""


def long_tail_length(rng: random.Random, median: float = LONG_TAIL_MEDIAN, sigma: float = LONG_TAIL_SIGMA) -> int:
    """One completion length drawn log-normal (at least one token)."""
    return max(1, round(rng.lognormvariate(math.log(median), sigma)))


class LongTailTask(SyntheticTask):
    """`long_tail`: the addition task whose samples each have a set completion length, drawn from a seeded
    log-normal (median LONG_TAIL_MEDIAN tokens, p99 10x that; one draw per sample of a group, seeded by the task's
    seed and the prompt's index): the heavy-tailed length workload of the CPU twin (issue #29). The engine samples
    exactly that many tokens from the policy, a stop token sampled like any other (`GenerationRequest.ignore_stop`,
    vLLM's ignore_eos), so the tiny model really decodes a heavy-tailed workload; the reward reads the text up to
    the first stop token (TextCodec.decode_completion), as for `addition`. Lengths are capped by the task's
    `algo.max_new_tokens`."""

    def __init__(self, spec: DatasetSpec):
        super().__init__(spec, _WithMistake("addition"))

    def completion_tokens(self, sample: Sample, samples: int) -> list[int] | None:
        rng = random.Random(f"long_tail-lengths-{self._seed}-{sample.index}")
        return [long_tail_length(rng) for _ in range(samples)]


STORIES = {"gsm8k_synth": synthetic_gsm8k, "gsm8k_easy": one_step_gsm8k}
"""Generated GSM8K-style kinds: two- and three-step stories, or one-step ones a small model learns on a CPU."""


class _Gsm8kStory:
    """A generated GSM8K-style problem worded for the prompt format (a class: tasks must pickle)."""

    def __init__(self, kind: str, prompt_format: str, answer_format: str | None):
        self.kind, self.prompt_format, self.answer_format = kind, prompt_format, answer_format

    def __call__(self, rng: random.Random) -> tuple[str, str, dict]:
        question, answer, meta = STORIES[self.kind](rng)
        sample = gsm8k_sample(0, question, answer, meta, self.prompt_format, self.answer_format)
        return sample.prompt, answer, sample.meta


class Gsm8kSyntheticTask(Gsm8kTask, SyntheticTask):
    """Generated GSM8K-style word problems (tasks/gsm8k.py `synthetic_gsm8k`, `one_step_gsm8k`); reward by
    math-verify."""

    def __init__(self, spec: DatasetSpec, prompt_format: str = "raw"):
        self.answer_format = spec.answer_format
        super().__init__(spec, _Gsm8kStory(spec.kind, prompt_format, spec.answer_format))

"""Synthetic verifiable tasks the tiny model can learn on two CPU cores.

Each generator also returns a plausible systematic mistake (addition without carries, reversal that only
swaps the ends, counting in the first four letters, sorting all but the last digit). It agrees with the
right answer on part of the inputs. The tiny model is pre-trained on a mix of right and mistaken answers,
so it starts as a policy that is sometimes right and can be taught the right rule by reward alone.

Each prompt ends with '=' and the answer follows directly, then end-of-sequence. Train and eval splits are
drawn from one seeded generator; eval prompts never appear in the train stream.
"""
from __future__ import annotations

import random
import string

from marlaas_hpc.tasks.base import Sample, TaskData
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


class SyntheticTask(TaskData):
    """A generated task: exact-match reward on the stripped completion."""

    def __init__(self, spec: DatasetSpec):
        self.kind = spec.kind
        self._make = GENERATORS[spec.kind]
        self._seed = spec.seed
        rng = random.Random(f"{spec.kind}-eval-{spec.seed}")
        self._eval: list[Sample] = []
        seen: set[str] = set()
        for _ in range(spec.eval_size * 20):
            if len(self._eval) == spec.eval_size:
                break
            prompt, answer, mistake = self._make(rng)
            if prompt not in seen:
                seen.add(prompt)
                self._eval.append(Sample(len(self._eval), prompt, answer, {"mistake": mistake}))
        self._eval_prompts = frozenset(seen)

    def train_sample(self, cursor: int) -> Sample:
        rng = random.Random(f"{self.kind}-train-{self._seed}-{cursor}")
        while True:
            prompt, answer, mistake = self._make(rng)
            if prompt not in self._eval_prompts:
                return Sample(cursor, prompt, answer, {"mistake": mistake})

    def eval_samples(self) -> list[Sample]:
        return list(self._eval)

    def score(self, sample: Sample, completion: str) -> float:
        return 1.0 if completion.strip() == sample.answer else 0.0

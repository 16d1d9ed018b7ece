"""A tenant's own reward function (see sums-carol.yaml): run only in the env ranks' sandboxed workers."""


def score(sample, completion):
    """1 for the exact sum, else partial credit per right digit in place (at most 0.5)."""
    answer = completion.strip()
    if answer == sample.answer:
        return 1.0
    right = sum(a == b for a, b in zip(answer, sample.answer))
    return 0.5 * right / max(len(sample.answer), 1)

"""Packed training rows: a micro-batch's sequences laid out without padding, each prompt once for its samples.

A GRPO step trains G samples of each prompt. Padded to one length, a fused step of short and long sequences ran
several times the tokens it trains (a lookup task's 40-token episodes next to 9-token additions: 4.3x), and every
sample repeated its prompt (on local-demo about half the tokens). Here the sequences of one task share rows:

    row:        [ prompt a | completion a1 | completion a2 | prompt b | completion b1 | ... | padding ]
    positions:    0 .. Pa-1  Pa .. Pa+n1-1   Pa .. Pa+n2-1   0 .. Pb-1  Pb ..
    attends to:   prompt a    prompt a, a1    prompt a, a2    prompt b    prompt b, b1

Each completion sees its prompt and itself only, at the positions it has alone (`positions`, RoPE's), so every
token's logits are those of the sequence on its own. The rows carry who-sees-whom as segment ids per position
(`prompt_of`, `own`); trainer/attention.py turns them into the attention kernel's mask on the device. A trained
token is read off the logits where its predecessor sits (`token_row`, `token_source`): the first token of every
completion of a prompt from the prompt's last position, the next ones from the completion's own tokens. Rows
hold one task each (rows pick their LoRA adapter), prompts are matched by their token ids within a task, and a
prompt is repeated in another row when its completions do not fit one (rows are `width` long: at least the
longest sequence).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from marlaas_hpc.trainer.attention import PADDING
from marlaas_hpc.trajectory import Trajectory


@dataclass
class PackedBatch:
    """Row tensors [rows, width] and one entry per trained token (completion tokens, in item order by task)."""

    ids: torch.Tensor
    positions: torch.Tensor
    prompt_of: torch.Tensor
    """Per position: the index (in its row) of the prompt occurrence it belongs to; -1 = padding."""
    own: torch.Tensor
    """Per position: -1 for a prompt token, the item index for a completion token, PADDING for padding."""
    tasks: list[str | None]
    """Each row's adapter."""
    token_row: torch.Tensor
    token_source: torch.Tensor
    """Where each trained token's logits are: (row, position of the token before it in its sequence)."""
    targets: torch.Tensor
    mask: torch.Tensor
    behaviour: torch.Tensor
    advantages: torch.Tensor
    task_spans: list[tuple[str | None, int, int]]
    """(task, first token, end) of each task's trained tokens: contiguous, in the rows' task order."""
    item_spans: list[tuple[int, int]] = field(default_factory=list)
    """(first token, count) of each item's completion in the trained tokens."""
    sequence: torch.Tensor | None = None
    """Per trained token: the index of its item (sequence-level objectives group tokens by it)."""
    versions: torch.Tensor | None = None
    """Per trained token: its behaviour version (TIS looks up the trainer's logprobs at it)."""
    routes: torch.Tensor | None = None
    """Routing replay: [rows, width, MoE layers, k] int16, the experts the rollout chose at each position (a
    prompt's from the trajectory that placed it in the row); None when no item replays."""
    route_mask: torch.Tensor | None = None
    """[rows, width] bool: the positions whose `routes` are recorded and replayed."""

    def to(self, device) -> "PackedBatch":
        moved = {name: value.to(device) if isinstance(value, torch.Tensor) else value
                 for name, value in self.__dict__.items()}
        return PackedBatch(**moved)


@dataclass
class _Row:
    task: str | None
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    prompt_of: list[int] = field(default_factory=list)
    """Per position: the index (in this row) of the prompt occurrence it belongs to; -1 = padding."""
    own: list[int] = field(default_factory=list)
    """Per position: -1 for a prompt token, else the item whose completion it is."""
    prompts: dict[tuple[int, ...], tuple[int, int]] = field(default_factory=dict)
    """Prompt ids -> (occurrence id, position of its last token) of the prompts this row holds."""
    route_spans: list[tuple[int, int, int, int]] = field(default_factory=list)
    """(first position in the row, item, first position in the item's sequence, length) of every run of positions
    (a prompt, a completion): where their recorded routes are."""

    def room(self, width: int) -> int:
        return width - len(self.tokens)

    def add_prompt(self, prompt: tuple[int, ...], item: int) -> None:
        occurrence = len(self.prompts)
        self.route_spans.append((len(self.tokens), item, 0, len(prompt)))
        self.tokens += prompt
        self.positions += range(len(prompt))
        self.prompt_of += [occurrence] * len(prompt)
        self.own += [-1] * len(prompt)
        self.prompts[prompt] = (occurrence, len(self.tokens) - 1)

    def add_completion(self, prompt: tuple[int, ...], item: int, completion: list[int]) -> int:
        """Appends a completion after its prompt's occurrence in this row; returns its first position."""
        occurrence, _ = self.prompts[prompt]
        start = len(self.tokens)
        self.route_spans.append((start, item, len(prompt), len(completion)))
        self.tokens += completion
        self.positions += range(len(prompt), len(prompt) + len(completion))
        self.prompt_of += [occurrence] * len(completion)
        self.own += [item] * len(completion)
        return start


def pack(items: Sequence[tuple[str | None, Trajectory]], min_width: int, pad_id: int,
         width_multiple: int = 1, min_rows: int = 1, replay: Sequence[str | None] = ()) -> PackedBatch:
    """Lays out `items` ((task, trajectory), grouped by task) in rows of one task each (first fit, a prompt's
    completions longest first, each next to an occurrence of its prompt when one has room); rows are as wide as
    the longest item (at least `min_width`), rounded up to a multiple of `width_multiple`, and rows of padding
    (the last row's adapter) make up `min_rows`. The recorded routes of the items of the tasks in `replay` go into
    `routes` (trajectory.py `routes`)."""
    for _, traj in items:
        traj.check()
        if not traj.prompt_ids:
            raise ValueError(f"trajectory of {traj.task_id}: empty prompt")
    width = max([min_width, 2] + [len(t.prompt_ids) + len(t.completion_ids) for _, t in items])
    width = -(-width // width_multiple) * width_multiple
    rows: list[_Row] = []
    placed: dict[int, tuple[int, int]] = {}  # item -> (row, first position of its completion)
    for task in dict.fromkeys(task for task, _ in items):
        first = len(rows)
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        for i, (t, traj) in enumerate(items):
            if t == task:
                by_prompt.setdefault(tuple(traj.prompt_ids), []).append(i)
        for prompt, members in by_prompt.items():
            for i in sorted(members, key=lambda i: -len(items[i][1].completion_ids)):
                row = _row_for(rows, first, task, prompt, len(items[i][1].completion_ids), width, i)
                placed[i] = (row, rows[row].add_completion(prompt, i, list(items[i][1].completion_ids)))
    rows += [_Row(rows[-1].task if rows else None) for _ in range(min_rows - len(rows))]
    batch = _tensors(items, rows, placed, width, pad_id)
    batch.routes, batch.route_mask = _routes(items, rows, width, set(replay))
    return batch


def _row_for(rows: list[_Row], first: int, task, prompt: tuple[int, ...], length: int, width: int,
             item: int) -> int:
    """The row (of this task's, from `first`) a completion goes in: one that holds its prompt (anywhere before:
    the mask, not adjacency, ties a completion to its prompt), else one with room for both, else a new one."""
    for r in range(first, len(rows)):
        if prompt in rows[r].prompts and rows[r].room(width) >= length:
            return r
    for r in range(first, len(rows)):
        if rows[r].room(width) >= len(prompt) + length:
            rows[r].add_prompt(prompt, item)
            return r
    rows.append(_Row(task))
    rows[-1].add_prompt(prompt, item)
    return len(rows) - 1


def _tensors(items, rows: list[_Row], placed: dict[int, tuple[int, int]], width: int, pad_id: int) -> PackedBatch:
    n_rows = len(rows)
    ids = torch.full((n_rows, width), pad_id, dtype=torch.long)
    positions = torch.zeros(n_rows, width, dtype=torch.long)
    prompt_of = torch.full((n_rows, width), -1, dtype=torch.long)
    own = torch.full((n_rows, width), PADDING, dtype=torch.long)
    for r, row in enumerate(rows):
        n = len(row.tokens)
        ids[r, :n] = torch.tensor(row.tokens, dtype=torch.long)
        positions[r, :n] = torch.tensor(row.positions, dtype=torch.long)
        prompt_of[r, :n] = torch.tensor(row.prompt_of, dtype=torch.long)
        own[r, :n] = torch.tensor(row.own, dtype=torch.long)
    token_row, token_source, targets, mask, behaviour, advantages = [], [], [], [], [], []
    sequence, versions = [], []
    item_spans: list[tuple[int, int]] = [(0, 0)] * len(items)
    task_spans: list[tuple[str | None, int, int]] = []
    for i, (task, traj) in enumerate(items):
        row, start = placed[i]
        last_prompt = rows[row].prompts[tuple(traj.prompt_ids)][1]
        n = len(traj.completion_ids)
        item_spans[i] = (len(targets), n)
        if not task_spans or task_spans[-1][0] != task:
            if any(t == task for t, _, _ in task_spans):
                raise ValueError(f"items of task {task!r} are not contiguous")
            task_spans.append((task, len(targets), len(targets)))
        token_row += [row] * n
        token_source += [last_prompt] + list(range(start, start + n - 1)) if n else []
        targets += traj.completion_ids
        mask += traj.mask()
        behaviour += traj.behaviour_logprobs
        advantages += [float(traj.advantage)] * n
        sequence += [i] * n
        versions += [traj.behaviour_version] * n
        task_spans[-1] = (task, task_spans[-1][1], len(targets))
    return PackedBatch(
        ids=ids, positions=positions, prompt_of=prompt_of, own=own, tasks=[r.task for r in rows],
        token_row=torch.tensor(token_row, dtype=torch.long), token_source=torch.tensor(token_source, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long), mask=torch.tensor(mask, dtype=torch.float32),
        behaviour=torch.tensor(behaviour, dtype=torch.float32),
        advantages=torch.tensor(advantages, dtype=torch.float32),
        task_spans=task_spans, item_spans=item_spans, sequence=torch.tensor(sequence, dtype=torch.long),
        versions=torch.tensor(versions, dtype=torch.long))


def _routes(items, rows: list[_Row], width: int, replay: set) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The rows' recorded routes and where they are (PackedBatch `routes`, `route_mask`); (None, None) when no item
    of a replaying task carries routes."""
    recorded = {i: torch.as_tensor(traj.routes) for i, (task, traj) in enumerate(items)
                if task in replay and traj.routes is not None}
    if not recorded:
        return None, None
    shapes = {tuple(r.shape[1:]) for r in recorded.values()}
    if len(shapes) != 1:
        raise ValueError(f"recorded routes of different shapes [MoE layers, k] in one batch: {sorted(shapes)}")
    routes = torch.zeros(len(rows), width, *shapes.pop(), dtype=torch.int16)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, row in enumerate(rows):
        for start, item, source, length in row.route_spans:
            if item not in recorded:
                continue
            # the last completion token has a record only if the engine fed it
            n = max(0, min(length, recorded[item].shape[0] - source))
            routes[r, start: start + n] = recorded[item][source: source + n].to(torch.int16)
            mask[r, start: start + n] = True
    return routes, mask

"""Env workloads: GSM8K math (with/without a calculator), HotpotQA-style search QA, and the tool-only task.

Kinds (see `ENV_TASK_KINDS`, built by `build_env_task(spec)`):
- ``gsm8k_tool``: GSM8K JSONL ({"question", "answer": "... #### N"}); the model may call
  ``<tool name="calculator">expr</tool>``; the final turn is scored by math-verify on the text after '####'.
- ``gsm8k_plain``: the same data and verifier, single turn, no tool (a thread-safe twin of ``gsm8k``).
- ``hotpotqa``: JSONL {"question", "answer", optional "context"} where context is HotpotQA's
  [[title, [sentence, ...]], ...] or [{"title", "text"}, ...]. The search corpus is the JSONL file named by
  ``spec.corpus`` ({"title"?, "text"} or {"contents"} per line) or, without one, every context document of the
  data file. The model calls ``<tool name="search">query</tool>`` and answers with ``<answer>…</answer>``
  (or plain text); reward token F1 (``spec.metric = "em"``: exact match) after SQuAD normalisation.
- ``lookup``: synthetic, for the tiny char model: prompt ``c4+7=`` where c4's value (0-99) is drawn per
  sample and only the ``lookup`` tool knows it. Compact syntax (default): the turn ``?`` (or ``?c4``) looks the
  prompt's key up and the observation restates the sum with the value, ``23+7=``; the next turn answers
  ``30``. Without the tool the model can only guess (~1%). ``spec.syntax = "xml"`` uses the tag protocol.

Data files are read and checked at construction (task admission): a missing file or field, a non-UTF-8 line,
malformed JSON or an empty corpus raises SpecError naming the file and line.
"""
from __future__ import annotations

import random
import re
import string
from collections import Counter
from typing import Any

from marlaas_hpc.env.custom import reward_function
from marlaas_hpc.env.protocol import Environment, SingleTurnEnv
from marlaas_hpc.env.tools import (SYNTAXES, Bm25Index, Calculator, Document, Lookup, Search, ToolBox, ToolOutcome,
                                   ToolTask)
from marlaas_hpc.tasks.base import Sample
from marlaas_hpc.tasks.files import FileTask, read_jsonl_rows
from marlaas_hpc.tasks.registry import ENV_TASK_KINDS
from marlaas_hpc.tasks.gsm8k import Gsm8kTask, gsm8k_file_samples
from marlaas_hpc.tasks.spec import DatasetSpec, SpecError


# ---------------------------------------------------------------- data files
def load_corpus(path: str, field_name: str = "dataset.corpus") -> list[Document]:
    """A search corpus: JSONL with {"text", optional "title"} or {"contents": "title\\ntext"} per line."""
    documents = []
    for lineno, row in read_jsonl_rows(path, (), field_name, what="empty corpus"):
        text, title = row.get("text"), row.get("title", "")
        if text is None and isinstance(row.get("contents"), str):
            title, _, text = row["contents"].partition("\n")
            title = title.strip().strip('"')
        if not isinstance(text, str) or not text.strip() or not isinstance(title, str):
            raise SpecError(field_name, f"{path}:{lineno}: a corpus line needs a non-empty string 'text' "
                                        "(or 'contents') and an optional string 'title'")
        documents.append(Document(title, text))
    return documents


def context_documents(context: Any, where: str, field_name: str = "dataset.path") -> list[Document]:
    """HotpotQA 'context': [[title, [sentences]], ...] or [{"title", "text"}, ...]."""
    if not isinstance(context, list):
        raise SpecError(field_name, f"{where}: 'context' must be a list of documents")
    documents = []
    for item in context:
        if isinstance(item, dict) and isinstance(item.get("text"), str) and isinstance(item.get("title", ""), str):
            documents.append(Document(item.get("title", ""), item["text"]))
        elif isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], list) \
                and all(isinstance(s, str) for s in item[1]):
            documents.append(Document(item[0], "".join(item[1])))
        else:
            raise SpecError(field_name, f"{where}: a 'context' document must be [title, [sentences]] "
                                        "or {\"title\", \"text\"}")
    return documents


# ---------------------------------------------------------------- verifiers
_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.S)


def normalize_answer(text: str) -> str:
    """SQuAD / HotpotQA normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    if (pred in ("yes", "no", "noanswer") or ref in ("yes", "no", "noanswer")) and pred != ref:
        return 0.0
    pred_tokens, ref_tokens = pred.split(), ref.split()
    common = sum((Counter(pred_tokens) & Counter(ref_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def extract_answer(turn: str) -> str:
    match = _ANSWER.search(turn)
    return (match.group(1) if match else turn).strip()


# ---------------------------------------------------------------- GSM8K
GSM8K_TOOL_HINT = 'Use <tool name="calculator">expression</tool> for arithmetic. End with #### and the number.'


class Gsm8kEnvTask(Gsm8kTask, FileTask, ToolTask):
    """GSM8K-format math, reward by math-verify; with `calculator=True` a multi-turn calculator episode."""

    def __init__(self, spec: DatasetSpec, calculator: bool, prompt_format: str = "raw"):
        self.kind = "gsm8k_tool" if calculator else "gsm8k_plain"
        self.calculator = calculator
        self.answer_format = spec.answer_format
        self.tools = ToolBox([Calculator()] if calculator else [])
        hint = f"\n{GSM8K_TOOL_HINT}" if calculator else ""
        super().__init__(spec, gsm8k_file_samples(spec, prompt_format, hint))

    def new_env(self) -> Environment:
        return super().new_env() if self.calculator else SingleTurnEnv(self)


# ---------------------------------------------------------------- HotpotQA-style search QA
HOTPOT_HINT = 'Search with <tool name="search">query</tool>. Give the final answer as <answer>...</answer>.'


class HotpotQATask(FileTask, ToolTask):
    """Multi-hop QA over a local corpus with BM25 search; reward token F1 or exact match."""

    kind = "hotpotqa"

    def __init__(self, spec: DatasetSpec, corpus: str | None = None, metric: str = "f1", top_k: int = 3):
        if metric not in ("f1", "em"):
            raise SpecError("dataset.metric", f"must be 'f1' or 'em', got {metric!r}")
        self.metric = metric
        rows = read_jsonl_rows(spec.path, ("question", "answer"))
        if corpus:
            documents = load_corpus(corpus)
        else:
            documents, seen = [], set()
            for lineno, row in rows:
                for doc in context_documents(row.get("context", []), f"{spec.path}:{lineno}"):
                    if (doc.title, doc.text) not in seen:
                        seen.add((doc.title, doc.text))
                        documents.append(doc)
            if not documents:
                raise SpecError("dataset.corpus", f"{spec.path}: empty corpus: no 'context' documents and no "
                                                  "corpus file given")
        self.tools = ToolBox([Search(Bm25Index(documents), k=top_k)])
        samples = [Sample(i, f"Question: {row['question']}\n{HOTPOT_HINT}\n", row["answer"])
                   for i, (_, row) in enumerate(rows)]
        super().__init__(spec, samples)

    def score(self, sample: Sample, completion: str) -> float:
        answer = extract_answer(completion)
        return exact_match(answer, sample.answer) if self.metric == "em" else f1_score(answer, sample.answer)


# ---------------------------------------------------------------- lookup: learnable only with the tool
_KEY_LETTERS = "abcdef"


class LookupTask(ToolTask):
    """'c4+7=' where c4 is drawn per sample and only the lookup tool knows it. Exact-match reward."""

    kind = "lookup"
    compact_tool = "lookup"

    def __init__(self, spec: DatasetSpec, syntax: str = "compact"):
        if syntax not in SYNTAXES:
            raise SpecError("dataset.syntax", f"must be one of {SYNTAXES}, got {syntax!r}")
        self.syntax = syntax
        self.tools = ToolBox([Lookup(getattr(spec, "tool_latency_s", 0.0))])
        self._seed = spec.seed
        rng = random.Random(f"lookup-eval-{spec.seed}")
        self._eval: list[Sample] = []
        seen: set[str] = set()
        for _ in range(spec.eval_size * 20):
            if len(self._eval) == spec.eval_size:
                break
            sample = self._make(rng, len(self._eval))
            if sample.prompt not in seen:
                seen.add(sample.prompt)
                self._eval.append(sample)
        self._eval_prompts = frozenset(seen)

    def _make(self, rng: random.Random, index: int) -> Sample:
        key = rng.choice(_KEY_LETTERS) + str(rng.randint(0, 9))
        # one-digit addends: using the result is then the tiny model's own 2-digit + 1-digit addition skill
        value, addend = rng.randint(0, 99), rng.randint(1, 9)
        prompt = f"{key}+{addend}="
        if self.syntax == "xml":
            prompt += f' look {key} up: <tool name="lookup">{key}</tool>\n'
        # the mistake of a model that answers without the tool: the addend, as if the unknown key were 0
        return Sample(index, prompt, str(value + addend),
                      {"table": {key: value}, "key": key, "addend": addend, "mistake": str(addend)})

    def train_sample(self, cursor: int) -> Sample:
        rng = random.Random(f"lookup-train-{self._seed}-{cursor}")
        while True:
            sample = self._make(rng, cursor)
            if sample.prompt not in self._eval_prompts:
                return sample

    def eval_samples(self) -> list[Sample]:
        return list(self._eval)

    def default_argument(self, sample: Sample) -> str:
        return sample.meta["key"]

    def observation(self, sample: Sample, outcomes: list[ToolOutcome]) -> str:
        if self.syntax != "compact":
            return super().observation(sample, outcomes)
        outcome = outcomes[0]
        return f"{outcome.text}+{sample.meta['addend']}=" if outcome.ok else f"{outcome.text}\n"

    def score(self, sample: Sample, completion: str) -> float:
        text = completion.strip()
        if self.syntax == "xml":
            text = extract_answer(text)
        return 1.0 if text == sample.answer else 0.0

    def demonstration(self, sample: Sample, use_tool: bool) -> list[tuple[str, bool]]:
        """An episode as (text, is_model_turn) segments, for supervised warm-up of a base model (each model
        segment is followed by eos). With the tool it is correct: ['?', '23+17=', '40'] in compact syntax;
        without it, the realistic mistake of answering blind: ['17'] (the addend, as if the key were 0)."""
        if not use_tool:
            return [(sample.meta["mistake"], True)]
        observation = self.observation(sample, [ToolOutcome("lookup", sample.meta["key"],
                                                            str(sample.meta["table"][sample.meta["key"]]), True, 0.0)])
        call = "?" if self.syntax == "compact" else f'<tool name="lookup">{sample.meta["key"]}</tool>'
        answer = sample.answer if self.syntax == "compact" else f"<answer>{sample.answer}</answer>"
        return [(call, True), (observation, False), (answer, True)]

    def demonstration_ids(self, codec, sample: Sample, use_tool: bool) -> tuple[list[int], list[int], list[int]]:
        """(prompt_ids, completion_ids, loss_mask) of a demonstration, tokenised exactly as the episode runner
        does (model segments end with eos and are masked in; observations are masked out)."""
        completion, mask = [], []
        for text, is_model in self.demonstration(sample, use_tool):
            ids = codec.encode_completion(text) if is_model else codec.tokenizer.encode(text, add_special_tokens=False)
            completion += ids
            mask += [int(is_model)] * len(ids)
        return codec.encode_prompt(sample.prompt), completion, mask


# ---------------------------------------------------------------- kinds
def build_env_task(spec: DatasetSpec, prompt_format: str = "raw", sandbox=None) -> ToolTask:
    """Builds an env workload; optional spec fields (read if the DatasetSpec has them): corpus, metric,
    syntax, tool_latency_s, reward_fn (replaces the workload's verifier; a tenant file runs sandboxed under
    `sandbox`, the job's SandboxConfig). `prompt_format` words GSM8K prompts."""
    task = _env_task(spec, prompt_format)
    if getattr(spec, "reward_fn", None):
        # an instance attribute shadows the method; it pickles (process pools) as the file's source
        task.score = reward_function(spec, sandbox)
    return task


def _env_task(spec: DatasetSpec, prompt_format: str) -> ToolTask:
    if spec.kind in ("gsm8k_tool", "gsm8k_plain"):
        return Gsm8kEnvTask(spec, calculator=spec.kind == "gsm8k_tool", prompt_format=prompt_format)
    if spec.kind == "hotpotqa":
        return HotpotQATask(spec, corpus=getattr(spec, "corpus", None), metric=getattr(spec, "metric", None) or "f1")
    if spec.kind == "lookup":
        return LookupTask(spec, syntax=getattr(spec, "syntax", None) or "compact")
    raise SpecError("dataset.kind", f"not an env workload: {spec.kind!r}; env kinds: {list(ENV_TASK_KINDS)}")

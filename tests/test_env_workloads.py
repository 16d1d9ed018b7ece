"""Env workloads: data files refused at admission with file and line, GSM8K (+calculator), HotpotQA search,
and the lookup task that only a tool user can solve."""
import json
import re
from pathlib import Path

import pytest

from marlaas_hpc.env import (EnvPool, EnvPoolConfig, EpisodeLimits, EpisodeRequest, EpisodeRunner, HotpotQATask,
                             LookupTask, build_env_task, environment_for)
from marlaas_hpc.env.workloads import exact_match, f1_score
from marlaas_hpc.model.codec import TextCodec
from marlaas_hpc.model.tokenizer import build_char_tokenizer
from marlaas_hpc.tasks import DatasetSpec, SpecError
from support.episodes import solve_lookup
from support.scripted_engine import ScriptedEngine

FIXTURES = Path(__file__).parent / "fixtures" / "env"
CODEC = TextCodec(build_char_tokenizer())
GOOD_QA = {"question": "q?", "answer": "a", "context": [["T", ["text."]]]}


def write_lines(path: Path, lines: list) -> str:
    path.write_bytes(b"\n".join(line if isinstance(line, bytes) else json.dumps(line).encode() for line in lines))
    return str(path)


@pytest.mark.parametrize("kind, lines, where, says", [
    ("gsm8k_tool", [{"question": "q", "answer": "#### 1"}, {"question": "q"}], 2, "answer"),
    ("gsm8k_tool", [{"question": "q", "answer": "#### 1"}, {"question": "q", "answer": "no final"}], 2, "####"),
    ("gsm8k_plain", [{"question": "q", "answer": "#### 1"}, b'{"question": "q", "answer": "#### \xff"}'], 2,
     "UTF-8"),
    ("hotpotqa", [GOOD_QA, GOOD_QA, b"{not json"], 3, "malformed JSON"),
    ("hotpotqa", [GOOD_QA, {"question": "q?", "answer": "a", "context": [["T", "not a list"]]}], 2, "context"),
    ("hotpotqa", [{"question": "", "answer": "a", "context": []}], 1, "question"),
])
def test_bad_data_files_are_refused_naming_file_and_line(tmp_path, kind, lines, where, says):
    path = write_lines(tmp_path / "data.jsonl", lines)
    with pytest.raises(SpecError) as err:
        build_env_task(DatasetSpec(kind=kind, path=path))
    assert f"{path}:{where}:" in str(err.value) and says in str(err.value)


def test_missing_empty_and_corpus_files_are_refused(tmp_path):
    with pytest.raises(SpecError, match="not found"):
        build_env_task(DatasetSpec(kind="gsm8k_tool", path=str(tmp_path / "nope.jsonl")))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(SpecError, match=f"{empty}: no samples"):
        build_env_task(DatasetSpec(kind="hotpotqa", path=str(empty)))
    questions = write_lines(tmp_path / "q.jsonl", [{"question": "q?", "answer": "a"}])
    with pytest.raises(SpecError, match="empty corpus") as err:  # no contexts, no corpus file
        build_env_task(DatasetSpec(kind="hotpotqa", path=questions))
    assert err.value.field == "dataset.corpus"
    with pytest.raises(SpecError, match=f"{empty}: empty corpus"):
        HotpotQATask(DatasetSpec(kind="hotpotqa", path=questions), corpus=str(empty))
    bad_corpus = write_lines(tmp_path / "c.jsonl", [{"text": "ok"}, {"title": "no text"}])
    with pytest.raises(SpecError, match=f"{bad_corpus}:2:"):
        HotpotQATask(DatasetSpec(kind="hotpotqa", path=questions), corpus=bad_corpus)
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(SpecError, match=f"{binary}:2: not UTF-8"):
        HotpotQATask(DatasetSpec(kind="hotpotqa", path=questions), corpus=str(binary))


def all_samples(task):
    """Eval split plus one pass over the train split (file tasks hold out len // 5 samples)."""
    n_train = len(task._train)
    return task.eval_samples() + [task.train_sample(i) for i in range(n_train)]


def play(task, policy, n, mode="thread", samples=None, **limits):
    engine = ScriptedEngine(CODEC, policy)
    with EnvPool(EnvPoolConfig(mode=mode, workers=2)) as pool:
        runner = EpisodeRunner(engine, CODEC, pool, EpisodeLimits(**({"max_total_tokens": 2048} | limits)))
        samples = samples or task.eval_samples()[:n]
        return runner.run([EpisodeRequest(task.kind, "g", s, environment_for(task), max_new_tokens=200)
                           for s in samples])


def test_gsm8k_with_calculator_scores_by_math_verify_in_pool_threads():
    task = build_env_task(DatasetSpec(kind="gsm8k_tool", path=str(FIXTURES / "gsm8k_mini.jsonl"), eval_size=5))
    answers = {"Natalia": "72", "Weng": "10", "robe": "3", "James": "624", "Betty": "5"}

    def policy(request, context):
        if "<result>" not in context:
            return 'half: <tool name="calculator">48 / 2</tool>'
        gold = next(v for k, v in answers.items() if k in context)
        return f"so the total is {gold}.\n#### {gold}" if "James" not in context else "#### 625"

    results = play(task, policy, 5, samples=all_samples(task))
    assert sorted(r.reward for r in results) == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert all(r.turns == 2 and r.tool_calls == 1 and r.transcript[2] == ("tool", "<result>24</result>\n")
               for r in results)


def test_gsm8k_plain_is_single_turn():
    task = build_env_task(DatasetSpec(kind="gsm8k_plain", path=str(FIXTURES / "gsm8k_mini.jsonl"), eval_size=5))
    results = play(task, lambda r, c: '<tool name="calculator">1+1</tool> #### 72', 5, samples=all_samples(task))
    assert all(r.turns == 1 and r.tool_calls == 0 for r in results)
    assert sorted(r.reward for r in results) == [0.0, 0.0, 0.0, 0.0, 1.0]  # only Natalia's answer is 72


@pytest.mark.parametrize("corpus", [None, str(FIXTURES / "corpus_mini.jsonl")])
def test_hotpotqa_search_then_answer(corpus):
    task = HotpotQATask(DatasetSpec(kind="hotpotqa", path=str(FIXTURES / "hotpotqa_mini.jsonl"), eval_size=4),
                        corpus=corpus)

    def policy(request, context):
        if context.count("<result>") == 0:
            return '<tool name="search">Brandenburg Gate city</tool>'
        if context.count("<result>") == 1:
            return '<tool name="search">river Berlin</tool>'
        return "<answer>the Spree</answer>" if "Spree" in context else "<answer>unknown</answer>"

    results = play(task, policy, 4, samples=all_samples(task))
    brandenburg = [r for r in results if "Brandenburg" in r.transcript[0][1]]
    assert brandenburg and brandenburg[0].reward == 1.0 and brandenburg[0].turns == 3
    assert "[1] Brandenburg Gate:" in brandenburg[0].transcript[2][1]
    assert all(r.finish == "answer" for r in results)


def test_qa_metrics():
    assert exact_match("The Spree.", "spree") == 1.0 and exact_match("Spree river", "Spree") == 0.0
    assert f1_score("Spree river", "Spree") == pytest.approx(2 / 3)
    assert f1_score("no", "yes") == 0.0 and f1_score("yes", "yes") == 1.0


def test_lookup_task_needs_the_tool():
    task = LookupTask(DatasetSpec(kind="lookup", eval_size=64, seed=1))
    train = [task.train_sample(i) for i in range(2000)]
    assert {s.prompt for s in train}.isdisjoint({s.prompt for s in task.eval_samples()})
    assert task.train_sample(7) == task.train_sample(7) and len(task.eval_samples()) == 64
    by_key: dict[str, set] = {}
    for s in train:
        by_key.setdefault(s.meta["key"], set()).add(s.meta["table"][s.meta["key"]])
    assert min(len(values) for values in by_key.values()) > 10  # a key's value cannot be memorised

    def guess(request, context):  # the best a tool-less policy can do: the addend plus the mean value
        return str(int(re.search(r"\+(\d+)=$", context).group(1)) + 50)

    tool_rewards = [r.reward for r in play(task, solve_lookup, 64)]
    guess_rewards = [r.reward for r in play(task, guess, 64)]
    assert sum(tool_rewards) == 64 and sum(guess_rewards) <= 4
    sample = task.eval_samples()[0]
    demo = task.demonstration(sample, use_tool=True)
    assert [model for _, model in demo] == [True, False, True] and demo[2][0] == sample.answer
    assert len(sample.prompt) + sum(len(text) + model for text, model in demo) <= 24  # short for a char model
    engine = ScriptedEngine(CODEC, solve_lookup, logprob=0.0)
    [result] = EpisodeRunner(engine, CODEC).run([EpisodeRequest("lookup", "g", sample, environment_for(task))])
    prompt_ids, completion_ids, mask = task.demonstration_ids(CODEC, sample, use_tool=True)
    assert (prompt_ids, completion_ids, mask) == (result.trajectory.prompt_ids, result.trajectory.completion_ids,
                                                  result.trajectory.loss_mask)


def test_lookup_xml_syntax():
    task = LookupTask(DatasetSpec(kind="lookup", eval_size=4), syntax="xml")

    def policy(request, context):
        if "<result>" not in context:
            return re.search(r'<tool name="lookup">\w+</tool>', context).group(0)
        value = int(re.search(r"<result>(\d+)</result>", context).group(1))
        addend = int(re.search(r"\+(\d+)=", context).group(1))
        return f"<answer>{value + addend}</answer>"

    assert [r.reward for r in play(task, policy, 4)] == [1.0] * 4

"""Tool use is learnable: on the lookup workload (solvable only by calling the tool), GRPO over multi-turn
episodes raises the tiny model's greedy eval accuracy by >= 20 points and its tool-call rate, in one process
(HF engine, EpisodeRunner, trainer). The base model samples the tool call now and then but greedily answers
blind (see tiny_model.py)."""
import pytest

from marlaas_hpc.model import TextCodec
from marlaas_hpc.rollout import AdapterRef, make_engine
from marlaas_hpc.rollout.base import AdapterVersions
from marlaas_hpc.tasks import TaskSpec
from support.local_driver import LocalDriver


def test_a_pinned_version_outlives_its_supersession_until_unpinned():
    versions = AdapterVersions()
    versions.add(AdapterRef("t", 0, "/a/0"))
    versions.pin("t", 0)
    versions.pin("t", 0)
    assert versions.add(AdapterRef("t", 1, "/a/1")) == [] and versions.live("t") == [0, 1]
    assert versions.unpin("t", 0) == [] and versions.pinned("t") == {0: 1}
    assert versions.unpin("t", 0) == [("t", 0)] and versions.live("t") == [1]
    with pytest.raises(KeyError):
        versions.unpin("t", 0)
    with pytest.raises(KeyError):
        versions.pin("t", 0)  # retired: an episode cannot start on it


@pytest.mark.slow
def test_grpo_raises_lookup_accuracy_and_tool_call_rate(tiny_model_path, tmp_path, capsys):
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    codec = TextCodec.from_pretrained(tiny_model_path)
    engine = make_engine("hf", tiny_model_path, seed=0)
    trainer = MultiLoraTrainer(TrainerConfig(model_path=str(tiny_model_path), seed=0))
    driver = LocalDriver(engine, trainer, codec, tmp_path, seed=0, log=lambda *_: None)
    driver.add_task(TaskSpec.from_dict({
        "task_id": "lookup", "tenant": "test", "dataset": {"kind": "lookup", "eval_size": 128},
        "lora": {"rank": 8, "alpha": 16}, "total_steps": 100,
        "algo": {"group_size": 8, "batch_prompts": 16, "lr": 3e-3, "max_new_tokens": 6, "max_turns": 3,
                 "max_episode_tokens": 40}}))
    base = driver.evaluate_episodes("lookup", use_adapter=False)
    steps, trained = 0, base
    while steps < 40 and trained["accuracy"] < base["accuracy"] + 0.25:
        for _ in range(10):
            driver.train("lookup", driver.rollout("lookup"))
        steps += 10
        trained = driver.evaluate_episodes("lookup")
    with capsys.disabled():
        print(f"\n[learning] lookup: greedy accuracy {base['accuracy']:.3f} -> {trained['accuracy']:.3f}, tool-call "
              f"rate {base['tool_call_rate']:.3f} -> {trained['tool_call_rate']:.3f} after {steps} GRPO steps")
    assert trained["accuracy"] >= base["accuracy"] + 0.20
    assert trained["tool_call_rate"] > base["tool_call_rate"]

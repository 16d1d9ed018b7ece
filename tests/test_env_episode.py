"""Multi-turn episode runner: token masks, version pinning, max-turn / max-token limits, single-turn adapter,
and one run against the real HfEngine on the tiny model (behaviour logprobs re-checked by a forward pass)."""
from marlaas_hpc.env import (EnvPool, EnvPoolConfig, Environment, EpisodeLimits, EpisodeRequest, EpisodeRunner, Final,
                             LookupTask, Observation, environment_for, summarize_episodes)
from marlaas_hpc.model.codec import TextCodec
from marlaas_hpc.model.tokenizer import build_char_tokenizer
from marlaas_hpc.rollout.base import AdapterRef
from marlaas_hpc.env import build_task_data
from marlaas_hpc.tasks import DatasetSpec
from support.episodes import solve_lookup
from support.scripted_engine import ScriptedEngine

CODEC = TextCodec(build_char_tokenizer())
LOOKUP = LookupTask(DatasetSpec(kind="lookup", eval_size=16, seed=3))


def requests_for(task, n, version=None, start=0, **kwargs):
    return [EpisodeRequest("lookup-task", f"g{i // 2}", task.train_sample(i), environment_for(task),
                           adapter_version=version, **kwargs) for i in range(start, start + n)]


def test_masks_cover_exactly_the_model_tokens():
    engine = ScriptedEngine(CODEC, solve_lookup, logprob=-0.25, steps=lambda r: 1 + int(r.request_id[-1]) % 3)
    runner = EpisodeRunner(engine, CODEC, EnvPool(EnvPoolConfig(mode="thread", workers=2)))
    results = runner.run(requests_for(LOOKUP, 8))
    assert [r.reward for r in results] == [1.0] * 8 and all(r.finish == "answer" for r in results)
    for result in results:
        traj = result.trajectory
        traj.check()
        assert traj.prompt_ids == CODEC.encode_prompt(result.request.sample.prompt)
        model = [t for t, m in zip(traj.completion_ids, traj.loss_mask) if m == 1]
        tool = [t for t, m in zip(traj.completion_ids, traj.loss_mask) if m == 0]
        turns = [text for kind, text in result.transcript if kind == "model"]
        observations = [text for kind, text in result.transcript if kind == "tool"]
        assert model == sum((CODEC.encode_completion(t) for t in turns), [])  # every model token, eos included
        assert CODEC.tokenizer.decode(tool) == "".join(observations)          # tool text is never trained
        assert all(lp == (-0.25 if m else 0.0) for lp, m in zip(traj.behaviour_logprobs, traj.loss_mask))
        assert result.turns == 2 and result.tool_calls == 1 and turns[0] == "?"
    summary = summarize_episodes(results)
    assert summary["tool_call_rate"] == 1.0 and summary["mean_reward"] == 1.0


def test_every_turn_keeps_the_version_of_the_first_turn():
    """The trainer publishes a new version during every engine step; episodes stay on their first version,
    which the engine keeps live (pinned) until the episode ends, then retires."""
    engine = ScriptedEngine(CODEC, lambda r, c: policy(r, c), check_versions=True,
                            steps=lambda r: 1 + len(engine.requests) % 2)
    engine.add_adapter(AdapterRef("lookup-task", 0, "/adapters/v0"))

    def policy(request, context):
        latest = engine.versions.latest["lookup-task"]
        engine.add_adapter(AdapterRef("lookup-task", latest + 1, f"/adapters/v{latest + 1}"))
        return "?" if context.count("<eos>") < 2 else "0"  # two tool calls, then an answer: 3 turns

    runner = EpisodeRunner(engine, CODEC)
    first = runner.run(requests_for(LOOKUP, 3), version_of=lambda task: engine.versions.latest[task])
    second = runner.run(requests_for(LOOKUP, 3, start=3), version_of=lambda task: engine.versions.latest[task])
    for result in first + second:
        assert result.turns == 3 and result.error is None
        assert result.trajectory.behaviour_version == result.adapter_version
    assert {r.adapter_version for r in first} == {0}
    assert {r.adapter_version for r in second} == {9} and engine.versions.latest["lookup-task"] == 18
    assert engine.versions.live("lookup-task") == [18]  # pins released: superseded versions retired
    per_request = {}
    for req in engine.requests:  # turn t+1's prompt extends turn t's: same episode, same version
        for other, version in per_request.items():
            if req.prompt_ids[:len(other)] == list(other):
                assert req.adapter_version == version
        per_request[tuple(req.prompt_ids)] = req.adapter_version


def test_engine_without_pinning_reports_a_retired_version_as_an_episode_error():
    engine = ScriptedEngine(CODEC, lambda r, c: policy(r, c), check_versions=True, supports_pin=False)
    engine.add_adapter(AdapterRef("lookup-task", 0, "/a/0"))

    def policy(request, context):
        engine.add_adapter(AdapterRef("lookup-task", engine.versions.latest["lookup-task"] + 1, "/a/n"))
        return "?"

    [result] = EpisodeRunner(engine, CODEC).run(requests_for(LOOKUP, 1, version=0))
    assert result.finish == "error" and isinstance(result.error, KeyError) and result.trajectory is None


def test_max_turns_ends_the_episode_with_reward_zero():
    engine = ScriptedEngine(CODEC, lambda r, c: "?")  # calls the tool forever
    runner = EpisodeRunner(engine, CODEC, limits=EpisodeLimits(max_turns=3, max_total_tokens=256))
    for result in runner.run(requests_for(LOOKUP, 4)):
        assert (result.finish, result.reward, result.turns, result.tool_calls) == ("max_turns", 0.0, 3, 3)
        assert result.transcript[-1][0] == "model" and result.trajectory.loss_mask[-1] == 1
        assert result.trajectory.reward == 0.0
    assert len(engine.requests) == 12


def test_max_total_tokens_caps_turns_and_stops_observations():
    limit = 16
    engine = ScriptedEngine(CODEC, lambda r, c: "?" if "<eos>" not in c else "9" * 100)
    runner = EpisodeRunner(engine, CODEC, limits=EpisodeLimits(max_turns=8, max_total_tokens=limit))
    for result in runner.run(requests_for(LOOKUP, 6, max_new_tokens=64)):
        traj = result.trajectory
        assert len(traj.prompt_ids) + len(traj.completion_ids) <= limit
        if result.finish == "max_tokens":  # the observation did not fit: not appended, reward 0
            assert result.transcript[-1] == ("model", "?") and result.reward == 0.0
        else:  # the answer turn was cut to the remaining budget and scored as it is
            assert result.finish == "answer" and len(traj.prompt_ids) + len(traj.completion_ids) == limit
    second_turns = [r for r in engine.requests if r.prompt_ids.count(CODEC.eos_id) == 1]
    assert all(r.max_new_tokens == limit - len(r.prompt_ids) for r in second_turns)
    assert {r.finish for r in runner.run(requests_for(LOOKUP, 6))} <= {"answer", "max_tokens"}


def test_single_turn_verifier_task_is_a_one_step_episode():
    task = build_task_data(DatasetSpec(kind="addition", eval_size=4))
    engine = ScriptedEngine(CODEC, lambda r, c: str(eval(c.replace("<bos>", "").rstrip("="))) if r.seed else "x")
    reqs = [EpisodeRequest("add", "g", task.train_sample(i), environment_for(task), seed=i) for i in range(4)]
    results = EpisodeRunner(engine, CODEC).run(reqs)
    assert [r.reward for r in results] == [0.0, 1.0, 1.0, 1.0]  # seed 0 -> policy answers 'x'
    assert all(r.turns == 1 and r.finish == "answer" and set(r.trajectory.loss_mask) == {1} for r in results)


class EchoEnv(Environment):
    """Two turns: the first gets the observation ' ok\\n', the second ends the episode (reward 1)."""

    def reset(self, sample):
        self.sample, self.turns = sample, 0
        return sample.prompt

    def step(self, model_turn):
        self.turns += 1
        return Observation(" ok\n", tool_calls=1) if self.turns == 1 else Final(1.0)


def test_real_hf_engine_multi_turn_logprobs_match_a_forward_pass(tiny_model_path):
    import torch

    from marlaas_hpc.rollout.hf_engine import HfEngine

    codec = TextCodec.from_pretrained(tiny_model_path)
    engine = HfEngine(tiny_model_path, device="cpu", seed=0)
    task = build_task_data(DatasetSpec(kind="addition", eval_size=4))
    reqs = [EpisodeRequest("add", "g", task.train_sample(i), EchoEnv(task), temperature=1.0, max_new_tokens=6,
                           seed=i) for i in range(4)]
    results = EpisodeRunner(engine, codec).run(reqs)
    model = engine.base  # no adapter was loaded: the engine's own base model, in eval mode
    for result in results:
        traj = result.trajectory
        assert result.turns == 2 and result.reward == 1.0 and result.adapter_version is None
        ids = torch.tensor([traj.prompt_ids + traj.completion_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
        n = len(traj.prompt_ids)
        recomputed = logp[n - 1:].gather(1, ids[0, n:, None])[:, 0]
        mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
        assert torch.allclose(recomputed[mask], torch.tensor(traj.behaviour_logprobs)[mask], atol=1e-4)
        assert codec.tokenizer.decode([t for t, m in zip(traj.completion_ids, traj.loss_mask) if not m]) == " ok\n"

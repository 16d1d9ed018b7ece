"""A rollout rank's engines of two base models behind the one-engine interface its loop drives
(rollout/model_engines.py, issue #28 item 2): each request goes to its task's model engine, the rank serves the
model rank 0 assigns (`follow`; a switch only once the awake engine is idle, the other model's requests waiting
meanwhile), pins of a sleeping model apply on its wake, and each model samples exactly what its own engine alone
samples. Two real models: the tiny char model and chat-mini (other tokenizer, vocabulary, size),
on the hf engine (the CPU twin: its sleep moves nothing on CPU)."""
import pytest

from marlaas_hpc.model import TextCodec
from marlaas_hpc.rollout import GenerationRequest, make_engine
from marlaas_hpc.rollout.engine_set import EngineSet
from marlaas_hpc.rollout.model_engines import ModelEngines


@pytest.fixture(scope="module")
def chat_path():
    from marlaas_hpc.model.chat_mini import ensure_chat_mini

    return ensure_chat_mini()


@pytest.fixture(scope="module")
def prompts(tiny_model_path, chat_path):
    tiny, chat = TextCodec.from_pretrained(tiny_model_path), TextCodec.from_pretrained(chat_path)
    return {"tiny": [tiny.encode_prompt(p) for p in ("12+7=", "sort 3 1 2:")],
            "chat": [chat.encode_prompt(p) for p in ("What is 3 + 4?", "Half of 10 is")]}


def engines(tiny_model_path, chat_path) -> ModelEngines:
    """The two models' engines, tiny awake (and served until rank 0 assigns another)."""
    return ModelEngines(EngineSet({"tiny": lambda: make_engine("hf", tiny_model_path, device="cpu"),
                                   "chat": lambda: make_engine("hf", chat_path, device="cpu")}))


def requests(model, prompts, tag="") -> list[GenerationRequest]:
    return [GenerationRequest(f"{model}{tag}-{i}", f"task-{model}", None, ids, temperature=0.0, max_new_tokens=5)
            for i, ids in enumerate(prompts[model])]


def run(engine, until: set[str]) -> dict:
    done = {}
    while not until.issubset(done):
        assert engine.has_unfinished()
        for gen in engine.step():
            done[gen.request_id] = gen
    return done


def test_each_request_samples_on_its_tasks_model_as_that_engine_alone(tiny_model_path, chat_path, prompts):
    engine = engines(tiny_model_path, chat_path)
    engine.assign("task-tiny", "tiny")
    engine.assign("task-chat", "chat")
    assert engine.awake == "tiny"
    mixed = requests("chat", prompts) + requests("tiny", prompts)
    engine.follow("chat")  # rank 0 gives the rank to chat, then back to tiny
    engine.submit(mixed)
    done = run(engine, {r.request_id for r in requests("chat", prompts)})
    engine.follow("tiny")
    done.update(run(engine, {r.request_id for r in requests("tiny", prompts)}))
    assert not engine.has_unfinished()
    assert [(s.from_model, s.to_model) for s in engine.pop_switches()] == [("tiny", "chat"), ("chat", "tiny")]
    for model, path in (("tiny", tiny_model_path), ("chat", chat_path)):
        alone = make_engine("hf", path, device="cpu").generate(requests(model, prompts))
        for gen in alone:
            assert done[gen.request_id].completion_ids == gen.completion_ids
            assert done[gen.request_id].logprobs == pytest.approx(gen.logprobs, abs=1e-5)


def test_a_switch_rank_0_assigns_waits_for_the_awake_engine_to_drain(tiny_model_path, chat_path, prompts):
    engine = engines(tiny_model_path, chat_path)
    engine.assign("task-tiny", "tiny")
    engine.assign("task-chat", "chat")
    first = requests("tiny", prompts, "a")
    engine.submit(first)  # tiny is awake and served: into its engine at once
    engine.submit(requests("chat", prompts))  # chat sleeps: waits
    engine.follow("chat")
    engine.submit(requests("tiny", prompts, "b"))  # tiny is no longer assigned: its new work waits
    assert engine.pending["tiny"] and engine.pending["chat"]
    order = []
    while engine.has_unfinished():
        order += [(engine.awake, gen.request_id) for gen in engine.step()]
    engine.follow("tiny")
    while engine.has_unfinished():
        order += [(engine.awake, gen.request_id) for gen in engine.step()]
    assert [model for model, _ in order] == ["tiny"] * 2 + ["chat"] * 2 + ["tiny"] * 2
    assert [r for _, r in order][:2] == [r.request_id for r in first]
    assert [(s.from_model, s.to_model) for s in engine.pop_switches()] == [("tiny", "chat"), ("chat", "tiny")]
    assert engine.pop_switches() == [] and engine.switches[-2:][0].total_s >= 0


def test_a_pin_of_a_sleeping_model_applies_when_it_wakes(tiny_model_path, chat_path):
    from marlaas_hpc.rollout import AdapterRef

    engine = engines(tiny_model_path, chat_path)
    engine.assign("task-chat", "chat")
    with pytest.raises(KeyError, match="no engine"):
        engine.assign("x", "llama")
    with pytest.raises(ValueError, match="belongs to model 'chat'"):
        engine.assign("task-chat", "tiny")
    with pytest.raises(KeyError, match="no model assigned"):
        engine.pin("unknown", 0)
    import torch

    chat = engine.engines._member("chat").engine
    tensors = {name: torch.zeros(shape) for name, shape in _lora_shapes(chat)}
    from marlaas_hpc.tasks.spec import LoraSpec

    lora = LoraSpec(rank=2, alpha=4, target_modules=("q_proj",))
    engine.add_adapter(AdapterRef("task-chat", 0, tensors=tensors, lora=lora))
    engine.pin("task-chat", 0)  # v0 is queued for chat's wake: the pin waits with it
    assert engine.pins["chat"] == [("pin", "task-chat", 0)]
    engine.submit([GenerationRequest("c0", "task-chat", 0, [1, 2, 3], temperature=0.0, max_new_tokens=2)])
    engine.follow("chat")
    run(engine, {"c0"})
    assert engine.awake == "chat" and engine.pins["chat"] == []
    assert chat.versions.pinned("task-chat") == {0: 1}


def _lora_shapes(hf_engine):
    """PEFT-named LoRA tensor shapes (rank 2, q_proj) of an hf engine's base model."""
    from marlaas_hpc.trainer.lora import peft_key

    config = hf_engine.base.config
    hidden, heads, head_dim = config.hidden_size, config.num_attention_heads, config.head_dim
    return [(peft_key(layer, "q_proj", "A"), (2, hidden)) for layer in range(config.num_hidden_layers)] + \
           [(peft_key(layer, "q_proj", "B"), (heads * head_dim, 2)) for layer in range(config.num_hidden_layers)]


def _adapter(hf_engine, task_id, version):
    import torch

    from marlaas_hpc.rollout import AdapterRef
    from marlaas_hpc.tasks.spec import LoraSpec

    generator = torch.Generator().manual_seed(version)
    tensors = {name: 0.1 * torch.randn(shape, generator=generator) for name, shape in _lora_shapes(hf_engine)}
    return AdapterRef(task_id, version, tensors=tensors, lora=LoraSpec(rank=2, alpha=4, target_modules=("q_proj",)))


def test_a_waiting_request_keeps_its_version_when_newer_ones_arrive_meanwhile(tiny_model_path, chat_path, prompts):
    """A request on v0 waits (rank 0 gave the rank to another model) while v1 and v2 arrive: it still samples on v0 (in a
    live job the engine retired v0 on v1's arrival and the waiting request failed: KeyError), then v2 serves,
    and v1, which nothing asked for, is retired unread."""
    engine = engines(tiny_model_path, chat_path)
    engine.assign("task-tiny", "tiny")
    engine.assign("task-chat", "chat")
    tiny = engine.engines.engine("tiny")
    engine.add_adapter(_adapter(tiny, "task-tiny", 0))  # tiny is awake, nothing waits: installed now
    engine.follow("chat")
    engine.submit(requests("chat", prompts))  # chat is served next ...
    on_v0 = [GenerationRequest("t-v0", "task-tiny", 0, prompts["tiny"][0], temperature=0.0, max_new_tokens=4)]
    engine.submit(on_v0)  # ... and tiny's request waits for rank 0 to give tiny the rank back
    engine.add_adapter(_adapter(tiny, "task-tiny", 1))
    engine.add_adapter(_adapter(tiny, "task-tiny", 2))
    assert [ref.version for ref in engine.deferred["tiny"]] == [1, 2]
    run(engine, {"chat-0", "chat-1"})
    engine.follow("tiny")
    done = run(engine, {"t-v0"})
    assert done["t-v0"].adapter_version == 0
    assert [ref.version for ref in engine.pop_retired()][:1] == [1]  # skipped unread; v0 goes once unused
    on_v2 = [GenerationRequest("t-v2", "task-tiny", 2, prompts["tiny"][0], temperature=0.0, max_new_tokens=4)]
    engine.submit(on_v2)
    assert run(engine, {"t-v2"})["t-v2"].adapter_version == 2
    assert tiny.versions.live("task-tiny") == [2]


def test_following_rank_0_only_the_assigned_model_is_served_and_it_switches_when_idle(tiny_model_path, chat_path,
                                                                                         prompts):
    engine = engines(tiny_model_path, chat_path)
    engine.assign("task-tiny", "tiny")
    engine.assign("task-chat", "chat")
    engine.follow("tiny")
    engine.submit(requests("tiny", prompts, "a") + requests("chat", prompts))
    order = []
    while engine.has_unfinished():
        order += [(engine.awake, gen.request_id) for gen in engine.step()]
    assert [model for model, _ in order] == ["tiny", "tiny"], "chat's requests wait: rank 0 did not assign chat"
    assert engine.pending["chat"] and engine.pop_switches() == []
    engine.submit(requests("tiny", prompts, "b"))  # in flight when rank 0 assigns chat: the switch waits for them
    engine.follow("chat")
    while engine.has_unfinished():
        order += [(engine.awake, gen.request_id) for gen in engine.step()]
    assert [model for model, _ in order[2:]] == ["tiny", "tiny", "chat", "chat"]
    assert [(s.from_model, s.to_model) for s in engine.pop_switches()] == [("tiny", "chat")]
    engine.follow("tiny")  # idle: the switch is made at the next step, with no request waiting
    assert engine.has_unfinished()
    assert engine.step() == [] and engine.awake == "tiny" and not engine.has_unfinished()

"""Shared fixtures: the tiny model (built once into the cache), PEFT adapters and references, the rollout
engine tests' codec / adapters / HF engine, and per-process thread limits."""
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# the benchmarks' studies (tools/studies/) and harnesses, imported by their tests as `studies.*`, `bench_*`
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))


@pytest.fixture(scope="session")
def tiny_model_path():
    from marlaas_hpc.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def qwen_path():
    """A random checkpoint of the Qwen3-0.6B architecture made small (qwen3-0.6b-mini), built once into the cache."""
    from marlaas_hpc.model.random_checkpoints import ensure_random_checkpoint

    return ensure_random_checkpoint("qwen3-0.6b-mini")


# --- rollout engines: LoRA adapters with non-zero weights and an independent HF+PEFT reference -------------
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="session")
def make_lora_adapter(tiny_model_path, tmp_path_factory):
    """make_lora_adapter(name, seed=0, r=8) -> path of a PEFT LoRA adapter with random non-zero weights on all
    seven Qwen3 projections of the tiny model (cached per (name, seed, r) for the session)."""
    made = {}
    root = tmp_path_factory.mktemp("lora_adapters")

    def make(name, seed=0, r=8):
        key = (name, seed, r)
        if key not in made:
            import torch
            from peft import LoraConfig, get_peft_model
            from transformers import AutoModelForCausalLM

            torch.manual_seed(seed)
            base = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
            config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=LORA_TARGETS, init_lora_weights=False)
            out = root / f"{name}-s{seed}-r{r}"
            get_peft_model(base, config).save_pretrained(str(out))
            made[key] = out
        return made[key]

    return make


@pytest.fixture(scope="session")
def peft_reference(tiny_model_path):
    """Independent transformers+PEFT reference, one unpadded row at a time, full recompute (no KV cache):
    `.greedy(adapter_path|None, prompt_ids, max_new_tokens) -> ids` (stops after eos) and
    `.logprobs(adapter_path|None, prompt_ids, completion_ids, temperature) -> list[float]`
    (teacher-forced log_softmax(logits / T) of the completion tokens; T = 0 reads as 1)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    eos = AutoTokenizer.from_pretrained(str(tiny_model_path)).eos_token_id
    models = {}

    def model_for(adapter_path):
        key = None if adapter_path is None else str(adapter_path)
        if key not in models:
            base = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()
            models[key] = base if key is None else PeftModel.from_pretrained(base, key).eval()
        return models[key]

    class Reference:
        @staticmethod
        @torch.no_grad()
        def greedy(adapter_path, prompt_ids, max_new_tokens):
            model, ids, out = model_for(adapter_path), list(prompt_ids), []
            for _ in range(max_new_tokens):
                tok = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
                ids.append(tok)
                out.append(tok)
                if tok == eos:
                    break
            return out

        @staticmethod
        @torch.no_grad()
        def logprobs(adapter_path, prompt_ids, completion_ids, temperature):
            ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
            logits = model_for(adapter_path)(input_ids=ids).logits[0, len(prompt_ids) - 1:-1]
            logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
            return logp.gather(1, torch.tensor(list(completion_ids))[:, None])[:, 0].tolist()

    return Reference()


# ---- rollout engine tests (test_rollout_*.py): the shared codec, two seeded adapters, an HF engine
@pytest.fixture(scope="module")
def codec(tiny_model_path):
    from marlaas_hpc.model import TextCodec

    return TextCodec.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def adapters(make_lora_adapter):
    return {"t1": make_lora_adapter("t1", seed=1), "t2": make_lora_adapter("t2", seed=2)}


@pytest.fixture(scope="module")
def hf_engine(tiny_model_path, adapters):
    from marlaas_hpc.rollout import AdapterRef, make_engine

    engine = make_engine("hf", tiny_model_path, seed=0)
    for task, path in adapters.items():
        engine.add_adapter(AdapterRef(task, 0, str(path)))
    return engine


def pytest_collection_modifyitems(config, items):
    """A test that uses the local Slurm cluster lives in a file named test_slurm_*.py: under pytest-xdist those
    files share one worker (`pytest_xdist_make_scheduler`), which only sees node ids."""
    for item in items:
        if item.get_closest_marker("slurm") and not item.path.name.startswith("test_slurm_"):
            raise pytest.UsageError(f"{item.nodeid} is marked slurm: its file's name must start with test_slurm_")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (`-n 2 --dist loadfile`, tools/test.sh) each test file runs whole on one worker, so its
    module fixtures (a job several tests read) run once; the test_slurm_*.py files share one worker, since the local
    cluster holds one four-component job at a time. (xdist's own `loadgroup` marks do not reach the node ids under
    pytest 9, which renamed the attribute xdist 3.8 rewrites.)"""
    from xdist.scheduler import LoadFileScheduling

    class OneWorkerPerFile(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "slurm" if Path(path).name.startswith("test_slurm_") else path

    return OneWorkerPerFile(config, log) if config.getvalue("dist") == "loadfile" else None

"""Tensor-parallel multi-LoRA on megatron-core's ColumnParallelLinear / RowParallelLinear (docs/architecture.md §10).

Every decoder layer has four adapter *sites*, one per megatron linear:

    site   megatron module                 parallel  HF modules (parts)
    qkv    self_attention.linear_qkv       column    q_proj, k_proj, v_proj (fused, per query group)
    proj   self_attention.linear_proj      row       o_proj
    fc1    mlp.linear_fc1                  column    gate_proj, up_proj (fused, [gate; up] per TP shard)
    fc2    mlp.linear_fc2                  row       down_proj

A mixture-of-experts layer (trainer/moe.py) has no mlp.linear_fc1 / fc2; each expert N has its own fc1 / fc2 pair
(mlp.experts.local_experts.N.linear_fc{1,2}, HF `mlp.experts.N.{gate,up,down}_proj`), split over TP like a dense
MLP's, and one `ExpertLoraSite` each (below: no activation communication, the replicated factor's gradient
summed over TP instead).

A site holds N named adapters (one per task), each with its own rank r and scaling alpha / r (as PEFT):

* column-parallel: A [r, in] replicated on every TP rank, B [out/tp, r] sharded exactly like W's rows. The
  low-rank hidden A·x goes through `copy_to_tensor_model_parallel_region` (identity forward, all-reduce
  backward), so A's gradient and the input gradient of the LoRA path are summed over the TP ranks.
* row-parallel: A [r, in/tp] sharded on W's input columns, B [out, r] replicated; the partial hidden A·x goes
  through `reduce_from_tensor_model_parallel_region` (all-reduce forward, identity backward).

A fused site has one A and one B; B rows of parts (q/k/v, gate/up) the task does not target are multiplied by
a 0/1 mask, so they stay zero and get no gradient. A shared A exports as identical lora_A of every targeted part
(exact: each part's update is B_part · A · x).

Per-row adapter choice: a `LoraContext` (held by the wrappers, not a module global) carries one adapter name
per batch row for the current forward (megatron activations are [seq, batch, hidden]); None = base only.
The adapters are not registered in the GPTModel, so the base model's parameters and state dict are untouched.
"""
from __future__ import annotations

import hashlib
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from marlaas_hpc.tasks.spec import QWEN3_LORA_TARGETS, LoraSpec

SITE_PARTS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "proj": ("o_proj",),
    "fc1": ("gate_proj", "up_proj"),
    "fc2": ("down_proj",),
}
SITE_MODULES = {"qkv": "self_attention.linear_qkv", "proj": "self_attention.linear_proj",
                "fc1": "mlp.linear_fc1", "fc2": "mlp.linear_fc2"}
HF_PREFIX = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def peft_key(layer: int, part: str, which: str) -> str:
    """The key PEFT's save_pretrained writes, e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight."""
    return f"base_model.model.model.layers.{layer}.{HF_PREFIX[part]}.{part}.lora_{which}.weight"


def expert_peft_key(layer: int, expert: int, part: str, which: str) -> str:
    """An expert's key in the per-expert form both stock vLLM and PEFT on transformers 5 load (docs/architecture.md
    §MoE), e.g. base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_A.weight."""
    return f"base_model.model.model.layers.{layer}.mlp.experts.{expert}.{part}.lora_{which}.weight"


class LoraContext:
    """Which adapter each batch row uses during the current forward (None: base only)."""

    def __init__(self):
        self._rows: tuple[str | None, ...] | None = None
        self._groups: dict[torch.device, list[tuple[str, torch.Tensor | None]]] = {}
        self._runs: list[tuple[str | None, int, int]] | None = None
        self._codes: dict[torch.device, torch.Tensor] = {}

    @property
    def rows(self) -> tuple[str | None, ...] | None:
        return self._rows

    @contextmanager
    def use(self, rows: Sequence[str | None] | str | None, batch: int | None = None) -> Iterator[None]:
        """Sets the adapters for the forwards inside the block; a single name (or None) applies to `batch` rows."""
        if rows is None or isinstance(rows, str):
            if batch is None:
                raise ValueError("a single adapter name needs the batch size")
            rows = [rows] * batch
        previous = (self._rows, self._groups, self._runs, self._codes)
        self._rows, self._groups, self._runs, self._codes = tuple(rows), {}, _runs_of(tuple(rows)), {}
        try:
            yield
        finally:
            self._rows, self._groups, self._runs, self._codes = previous

    @property
    def runs(self) -> list[tuple[str | None, int, int]] | None:
        """[(adapter name or None, first row, end row)] covering every row in order when each adapter's rows are
        one contiguous run (the trainer keeps a task's rows together), else None."""
        return self._runs

    def groups(self, device: torch.device) -> list[tuple[str, torch.Tensor | None]]:
        """[(adapter name, batch-row indices or None for 'every row')] for the adapters in use."""
        if not self._rows:
            return []
        if device not in self._groups:
            names = [n for n in dict.fromkeys(self._rows) if n is not None]
            if len(names) == 1 and all(r == names[0] for r in self._rows):
                self._groups[device] = [(names[0], None)]
            else:
                self._groups[device] = [
                    (n, torch.tensor([i for i, r in enumerate(self._rows) if r == n], dtype=torch.long,
                                     device=device)) for n in names]
        return self._groups[device]

    def row_codes(self, device: torch.device) -> tuple[list[str], torch.Tensor]:
        """(adapter names in use, each batch row's index into them or -1 for base only): expert sites look
        their tokens' rows up in it (a routed expert's tokens come from any rows, interleaved)."""
        names = [n for n in dict.fromkeys(self._rows or ()) if n is not None]
        if device not in self._codes:
            self._codes[device] = torch.tensor([names.index(r) if r is not None else -1 for r in self._rows],
                                               dtype=torch.long, device=device)
        return names, self._codes[device]


def _runs_of(rows: tuple[str | None, ...]) -> list[tuple[str | None, int, int]] | None:
    """Maximal runs of equal names; None when a name comes back after another (not contiguous)."""
    runs: list[tuple[str | None, int, int]] = []
    for index, name in enumerate(rows):
        if runs and runs[-1][0] == name:
            runs[-1] = (name, runs[-1][1], index + 1)
        else:
            runs.append((name, index, index + 1))
    names = [name for name, _, _ in runs if name is not None]
    return runs if len(names) == len(set(names)) else None


def _seed_for(*parts) -> int:
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def kaiming_uniform_a(rank: int, fan_in: int, seed: int) -> torch.Tensor:
    """PEFT's lora_A init (kaiming_uniform_ with a=sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in))), seeded."""
    generator = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(rank, fan_in, generator=generator, dtype=torch.float64) * 2 - 1).mul_(bound).float()


class _Float32Down(torch.autograd.Function):
    """x @ A.T in float32 (A float32, x in the base dtype), keeping x for backward rather than its float32 copy.

    `F.linear(x.float(), A)` keeps the float32 copy of x for A's gradient: with bf16 activations that is 2 bytes
    per element more than x itself, at all four sites of every layer (9 KB per token per layer at Qwen3-0.6B's
    shapes and TP=2, 150 MB per layer for a 16k-token micro-batch). The gradients are the same products."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, a)
        return F.linear(x.to(a.dtype), a)  # the float32 copy is freed on return

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, a = ctx.saved_tensors
        grad_x = grad_a = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad @ a).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_a = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).to(a.dtype)
        return grad_x, grad_a


class LoraAdapter(torch.nn.Module):
    """One task's A/B pair at one site (this rank's shards)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, scaling: float, mask: torch.Tensor | None,
                 a_sharded: bool, b_sharded: bool):
        super().__init__()
        self.lora_A = torch.nn.Parameter(a)
        self.lora_B = torch.nn.Parameter(b)
        self.lora_A.tp_sharded = a_sharded
        self.lora_B.tp_sharded = b_sharded
        self.scaling = float(scaling)
        self.register_buffer("mask", mask, persistent=False)

    def effective_b(self) -> torch.Tensor:
        return self.lora_B if self.mask is None else self.lora_B * self.mask

    def scaled_b(self) -> torch.Tensor:
        """B (masked) times alpha / r: the scaling applied to the [out, r] matrix, not to the activation-sized
        output of the B product (a full pass over the activations, forward and backward, per site and task)."""
        return self.effective_b() * self.scaling


class LoraSite:
    """The adapters of one megatron linear, applied by a forward hook (base module left as is)."""

    def __init__(self, module: torch.nn.Module, layer: int, site: str, ctx: LoraContext, tp_group):
        self.module, self.layer, self.site, self.ctx, self.tp_group = module, layer, site, ctx, tp_group
        self.label = site
        """The site's name within its layer (parameter names, A's seed)."""
        self.parts = SITE_PARTS[site]
        self.column = site in ("qkv", "fc1")
        self.tp_size = dist.get_world_size(tp_group)
        self.tp_rank = dist.get_rank(tp_group)
        out_local, in_local = module.weight.shape
        self.out_local, self.in_local = out_local, in_local
        self.out_full = out_local * self.tp_size if self.column else out_local
        self.in_full = in_local if self.column else in_local * self.tp_size
        self.adapters: dict[str, LoraAdapter] = {}
        self._handle = module.register_forward_hook(self._hook, with_kwargs=True)

    # -- layout -------------------------------------------------------------------------------------------
    def part_ids(self, full: bool) -> torch.Tensor:
        """Part index (into self.parts) of each B row, for this rank's shard or the TP-gathered B."""
        return torch.tensor(self.part_of_rows(full), dtype=torch.long)

    def part_of_rows(self, full: bool) -> list[int]:
        """`part_ids` as a host list: B's rows of one part are then selected without reading a device mask."""
        if self.site == "qkv":
            cfg = self.module.config
            head_dim = cfg.kv_channels
            groups = cfg.num_query_groups
            q_rows = head_dim * cfg.num_attention_heads // groups
            n_groups = groups if full else groups // self.tp_size
            return ([0] * q_rows + [1] * head_dim + [2] * head_dim) * n_groups
        if self.site == "fc1":
            half = self.out_local // 2
            return ([0] * half + [1] * half) * (self.tp_size if full else 1)
        return [0] * (self.out_full if full else self.out_local)

    # -- adapters -----------------------------------------------------------------------------------------
    def add(self, name: str, spec: LoraSpec, seed: int) -> LoraAdapter | None:
        targeted = [i for i, p in enumerate(self.parts) if p in spec.target_modules]
        if not targeted:
            return None
        weight = self.module.weight
        a_full = kaiming_uniform_a(spec.rank, self.in_full, _seed_for(seed, name, self.layer, self.label))
        if self.column:
            a = a_full
        else:
            a = a_full.chunk(self.tp_size, dim=1)[self.tp_rank].contiguous()
        b = torch.zeros(self.out_local if self.column else self.out_full, spec.rank)
        mask = None
        if len(targeted) < len(self.parts):
            mask = torch.isin(self.part_ids(full=False), torch.tensor(targeted)).float().unsqueeze(1)
            mask = mask.to(device=weight.device)
        # float32 whatever the base dtype (bf16 on GPU): the optimizer state and updates stay exact
        adapter = LoraAdapter(a.to(weight.device, torch.float32), b.to(weight.device, torch.float32),
                              spec.scaling, mask, a_sharded=not self.column, b_sharded=self.column)
        self.adapters[name] = adapter
        return adapter

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)

    def close(self) -> None:
        self._handle.remove()
        self.adapters.clear()

    # -- forward ------------------------------------------------------------------------------------------
    def _delta(self, adapter: LoraAdapter, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                                   reduce_from_tensor_model_parallel_region)

        if x.dtype == adapter.lora_A.dtype:
            hidden = F.linear(x, adapter.lora_A)
        else:  # the LoRA path runs in float32 whatever the base dtype
            hidden = _Float32Down.apply(x, adapter.lora_A)
        if self.column:
            hidden = copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)
        else:
            hidden = reduce_from_tensor_model_parallel_region(hidden, group=self.tp_group)
        return F.linear(hidden, adapter.scaled_b())

    def _hook(self, module, args, kwargs, output):
        if not self.adapters:
            return output
        groups = self.ctx.groups(module.weight.device)
        if not groups:
            return output
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        runs = self.ctx.runs
        if runs is not None and len(groups) > 1:
            return self._add_runs(out, x, runs), bias
        for name, rows in groups:
            adapter = self.adapters.get(name)
            if adapter is None:
                continue
            if rows is None:
                out = out + self._delta(adapter, x).to(out.dtype)
            else:
                out = out.index_add(1, rows, self._delta(adapter, x.index_select(1, rows)).to(out.dtype))
        return out, bias

    def _add_runs(self, out: torch.Tensor, x: torch.Tensor, runs) -> torch.Tensor:
        """Several adapters over contiguous row runs: each adapter's delta from a view of its rows, joined along
        the batch dim (zeros for rows without one) and added once. index_select/index_add per adapter would copy
        the whole activation once per adapter (a quarter of a fused step's time with four tasks)."""
        pieces = []
        for name, start, end in runs:
            adapter = self.adapters.get(name) if name is not None else None
            if adapter is None:
                pieces.append(out.new_zeros(out.shape[0], end - start, out.shape[2]))
            else:
                pieces.append(self._delta(adapter, x[:, start:end]).to(out.dtype))
        return out + torch.cat(pieces, dim=1)

    # -- HF layout ----------------------------------------------------------------------------------------
    def peft_key(self, part: str, which: str) -> str:
        return peft_key(self.layer, part, which)

    def _gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        if self.tp_size == 1:
            return tensor.detach().clone()
        pieces = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        dist.all_gather(pieces, tensor.detach().contiguous(), group=self.tp_group)
        return torch.cat(pieces, dim=dim)

    def to_hf(self, name: str, spec: LoraSpec, grads: bool = False) -> dict[str, torch.Tensor]:
        """{peft key: full tensor} of adapter `name` (collective over TP: every rank must call it)."""
        adapter = self.adapters[name]

        def value(p):
            if not grads:
                return p.data
            return p.grad if p.grad is not None else torch.zeros_like(p)

        a = value(adapter.lora_A)
        b = value(adapter.lora_B)
        a_full = a.detach().clone() if self.column else self._gather(a, dim=1)
        b_full = self._gather(b, dim=0) if self.column else b.detach().clone()
        part_of_rows = self.part_of_rows(full=True)
        a_host, b_host = a_full.cpu(), b_full.cpu()
        out = {}
        for index, part in enumerate(self.parts):
            if part in spec.target_modules:
                out[self.peft_key(part, "A")] = a_host.clone()  # own storage per part
                # rows picked by host indices: a boolean mask of device values has a data-dependent size (a
                # device-to-host sync per part on GPU; no size at all on the GPU dry run's fake tensors)
                rows = torch.tensor([row for row, of in enumerate(part_of_rows) if of == index])
                out[self.peft_key(part, "B")] = b_host.index_select(0, rows)
        return out

    @torch.no_grad()
    def from_hf(self, name: str, spec: LoraSpec, tensors: dict[str, torch.Tensor]) -> None:
        """Loads adapter `name` from full PEFT-layout tensors (every rank holds them all; no communication)."""
        adapter = self.adapters[name]
        targeted = [(i, p) for i, p in enumerate(self.parts) if p in spec.target_modules]
        a_list = [tensors[self.peft_key(p, "A")] for _, p in targeted]
        for other in a_list[1:]:
            if not torch.equal(other, a_list[0]):
                raise ValueError(f"layer {self.layer}: lora_A of {[p for _, p in targeted]} differ; the fused "
                                 f"megatron site '{self.label}' shares one A across them")
        a_full = a_list[0]
        part_ids = self.part_ids(full=True)
        b_full = torch.zeros(len(part_ids), spec.rank, dtype=torch.float32)
        for index, part in targeted:
            b_full[part_ids == index] = tensors[self.peft_key(part, "B")].to(b_full.dtype)
        if self.column:
            a_local, b_local = a_full, b_full.chunk(self.tp_size, dim=0)[self.tp_rank]
        else:
            a_local, b_local = a_full.chunk(self.tp_size, dim=1)[self.tp_rank], b_full
        if a_local.shape != adapter.lora_A.shape or b_local.shape != adapter.lora_B.shape:
            raise ValueError(f"layer {self.layer} site {self.label}: shapes {tuple(a_local.shape)}, "
                             f"{tuple(b_local.shape)} do not fit {tuple(adapter.lora_A.shape)}, "
                             f"{tuple(adapter.lora_B.shape)}")
        adapter.lora_A.copy_(a_local)
        adapter.lora_B.copy_(b_local)


class ExpertLoraSite(LoraSite):
    """The adapters of one expert's fc1 (column: gate/up) or fc2 (row: down), sharded over TP as the dense sites.

    Communication differs from a dense site: megatron runs the experts' linears without their own TP
    communication, and the dispatcher (trainer/moe.py `ReplicatedTokenDispatcher`) sums the ranks' partial input
    gradients at the layer's entry and their partial outputs at its exit. The LoRA path's partial results ride on
    those two sums, so it moves no activation; only the factor every rank holds whole (A at fc1, B at fc2) gets a
    partial gradient on each rank (its product with this rank's shard), summed over TP by `SumGradOverTP`.

    Tokens reach an expert in routing order, not by batch row: the dispatcher records each expert's token
    indices (seq-major, as megatron flattens [seq, batch, hidden]), so a token's row is its index mod batch."""

    def __init__(self, module: torch.nn.Module, layer: int, site: str, ctx: LoraContext, tp_group, local: int,
                 dispatcher):
        super().__init__(module, layer, site, ctx, tp_group)
        self.local, self.dispatcher = local, dispatcher
        self.expert = dispatcher.local_expert_indices[local]
        """The expert's index in the checkpoint (with expert parallelism: EP rank x local experts + `local`)."""
        self.ep_size = dispatcher.ep_size
        self.label = f"experts.{self.expert}.{site}"  # the global index: A's seed is the EP=1 one

    def peft_key(self, part: str, which: str) -> str:
        return expert_peft_key(self.layer, self.expert, part, which)

    def peer_keys(self, spec: LoraSpec) -> set[str]:
        """The PEFT keys of the experts the other EP ranks hold at this site's place (an adapter file has them)."""
        local = len(self.dispatcher.local_expert_indices)
        return {expert_peft_key(self.layer, rank * local + self.local, part, which)
                for rank in range(self.ep_size) for part in self.parts if part in spec.target_modules
                for which in "AB"} - {self.peft_key(part, which) for part in self.parts for which in "AB"}

    def add(self, name: str, spec: LoraSpec, seed: int) -> LoraAdapter | None:
        adapter = super().add(name, spec, seed)
        if adapter is not None and self.ep_size > 1:
            # this EP rank's experts only: summed over the expert-data-parallel group, and their norm over EP
            adapter.lora_A.expert_parallel = adapter.lora_B.expert_parallel = True
        return adapter

    def _delta(self, adapter: LoraAdapter, x: torch.Tensor) -> torch.Tensor:
        from marlaas_hpc.trainer.moe import SumGradOverTP

        a, b = adapter.lora_A, adapter.scaled_b()
        if self.tp_size > 1:
            if self.column:
                a = SumGradOverTP.apply(a, self.tp_group)
            else:
                b = SumGradOverTP.apply(b, self.tp_group)
        hidden = F.linear(x, a) if x.dtype == a.dtype else _Float32Down.apply(x, a)
        return F.linear(hidden, b)

    def _hook(self, module, args, kwargs, output):
        if not self.adapters or (not self.ctx.rows and self.ep_size == 1):
            return output
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        if self.ep_size > 1:  # tokens of every EP rank's rows: their adapter codes came with them
            names, token_codes = self.dispatcher.code_names, self.dispatcher.expert_codes[self.local]
            return self._add_by_code(out, x, names, token_codes), bias
        groups = self.ctx.groups(module.weight.device)
        if len(groups) == 1 and groups[0][1] is None:  # one adapter on every row: all of this expert's tokens
            adapter = self.adapters.get(groups[0][0])
            return (out if adapter is None else out + self._delta(adapter, x).to(out.dtype)), bias
        names, codes = self.ctx.row_codes(module.weight.device)
        batch = self.dispatcher.hidden_shape[1]
        if batch != len(self.ctx.rows):
            raise ValueError(f"layer {self.layer}: the MoE layer's batch is {batch} rows, the LoRA context names "
                             f"{len(self.ctx.rows)}")
        token_codes = codes[self.dispatcher.expert_token_ids[self.local] % batch]
        return self._add_by_code(out, x, names, token_codes), bias

    def _add_by_code(self, out: torch.Tensor, x: torch.Tensor, names: list[str], token_codes: torch.Tensor):
        """out plus each adapter's delta on the tokens whose code names it."""
        for code, name in enumerate(names):
            adapter = self.adapters.get(name)
            if adapter is None:
                continue
            # every TP rank routes the same tokens (replicated hidden states), so every rank runs the same deltas
            # and their gradient sums over TP match
            positions = (token_codes == code).nonzero().squeeze(1)
            out = out.index_add(0, positions, self._delta(adapter, x.index_select(0, positions)).to(out.dtype))
        return out


@dataclass
class _AdapterInfo:
    spec: LoraSpec
    seed: int


class MultiLora:
    """N named LoRA adapters over one (frozen) megatron GPTModel; forwards pick adapters per row via `ctx`."""

    def __init__(self, model: torch.nn.Module, ctx: LoraContext | None = None, tp_group=None, ep_group=None):
        from megatron.core import parallel_state

        self.ctx = ctx or LoraContext()
        self.tp_group = tp_group or parallel_state.get_tensor_model_parallel_group()
        self.ep_group = ep_group
        """The expert-parallel group (None: EP = 1): expert adapters are gathered and their norm summed over it."""
        self.sites: list[LoraSite] = []
        self.adapters: dict[str, _AdapterInfo] = {}
        layers = list(model.decoder.layers)
        # In a mixture-of-experts model gate/up/down_proj name the experts only: PEFT on transformers 5 moves those
        # names to the fused expert parameters, so a dense layer's MLP (`mlp_only_layers`) takes no adapter there
        # and would compute otherwise than the trainer
        routed = any(getattr(layer_module.mlp, "experts", None) is not None for layer_module in layers)
        for layer_module in layers:
            layer = layer_module.layer_number - 1
            for site, path in SITE_MODULES.items():
                if routed and site in ("fc1", "fc2"):
                    continue
                self.sites.append(LoraSite(layer_module.get_submodule(path), layer, site, self.ctx, self.tp_group))
            self.sites.extend(self._expert_sites(layer_module, layer))

    def _expert_sites(self, layer_module, layer: int) -> list["ExpertLoraSite"]:
        """fc1 and fc2 of every expert of a mixture-of-experts layer (none in a dense layer)."""
        experts = getattr(layer_module.mlp, "experts", None)
        if experts is None:
            return []
        dispatcher = layer_module.mlp.token_dispatcher
        if dispatcher.ep_size > 1:
            dispatcher.row_codes = self._row_codes
        return [ExpertLoraSite(expert.get_submodule(f"linear_{site}"), layer, site, self.ctx, self.tp_group,
                               index, dispatcher)
                for index, expert in enumerate(experts.local_experts) for site in ("fc1", "fc2")]

    def _row_codes(self) -> tuple[list[str], torch.Tensor | None]:
        """(every adapter's name, in the order every rank added them; each batch row's index into them or -1): the
        codes an expert-parallel dispatcher sends with the tokens (trainer/experts_parallel.py)."""
        names = list(self.adapters)
        if not self.ctx.rows:
            return names, None
        device = self.sites[0].module.weight.device
        return names, torch.tensor([names.index(row) if row is not None else -1 for row in self.ctx.rows],
                                   dtype=torch.long, device=device)

    def add_adapter(self, name: str, spec: LoraSpec, seed: int = 0) -> list[torch.nn.Parameter]:
        """Creates adapter `name` (A: seeded kaiming-uniform, identical on every TP rank; B: zeros)."""
        if name in self.adapters:
            raise KeyError(f"adapter {name!r} already exists")
        spec.validate()
        unknown = set(spec.target_modules) - set(QWEN3_LORA_TARGETS)
        if unknown:
            raise ValueError(f"unknown target modules {sorted(unknown)}")
        self._check_sites(spec)
        for site in self.sites:
            site.add(name, spec, seed)
        self.adapters[name] = _AdapterInfo(spec=spec, seed=seed)
        return self.parameters(name)

    def _check_sites(self, spec: LoraSpec) -> None:
        """Every targeted module has a site in the model (dense layers of an MoE model have no MLP site)."""
        missing = [part for part in spec.target_modules if not any(part in site.parts for site in self.sites)]
        if missing:
            raise ValueError(f"lora.target_modules: {missing} have no LoRA site in this model")

    def remove_adapter(self, name: str) -> None:
        for site in self.sites:
            site.remove(name)
        self.adapters.pop(name, None)

    def spec(self, name: str) -> LoraSpec:
        return self.adapters[name].spec

    def named_parameters(self, name: str) -> list[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters of adapter `name`, with stable names (layer.site.lora_A / lora_B)."""
        out = []
        for site in self.sites:
            adapter = site.adapters.get(name)
            if adapter is not None:
                out.append((f"{site.layer}.{site.label}.lora_A", adapter.lora_A))
                out.append((f"{site.layer}.{site.label}.lora_B", adapter.lora_B))
        return out

    def parameters(self, name: str) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named_parameters(name)]

    def local_state_dict(self, name: str) -> dict[str, torch.Tensor]:
        """This rank's shards of adapter `name` (for resume at the same TP size)."""
        return {k: p.detach().clone() for k, p in self.named_parameters(name)}

    @torch.no_grad()
    def load_local_state_dict(self, name: str, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.named_parameters(name))
        if set(params) != set(state):
            raise KeyError(f"adapter {name!r}: state keys differ from the adapter's parameters")
        for key, param in params.items():
            if state[key].shape != param.shape:
                raise ValueError(f"adapter {name!r}: {key} has shape {tuple(state[key].shape)}, "
                                 f"expected {tuple(param.shape)} (same TP size?)")
            param.copy_(state[key])

    def hf_state_dict(self, name: str, grads: bool = False) -> dict[str, torch.Tensor]:
        """Full (TP-gathered) PEFT-layout tensors of adapter `name` (or of its grads). Collective over TP."""
        from marlaas_hpc.trainer.experts_parallel import gather_expert_tensors

        spec = self.adapters[name].spec
        out: dict[str, torch.Tensor] = {}
        experts: dict[str, torch.Tensor] = {}
        for site in self.sites:
            if name in site.adapters:
                (experts if getattr(site, "ep_size", 1) > 1 else out).update(site.to_hf(name, spec, grads=grads))
        if self.ep_group is not None:  # every EP rank's experts (collective over the EP group)
            experts = gather_expert_tensors(experts, self.ep_group)
        out.update(experts)
        return out

    def load_hf_state_dict(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """Loads adapter `name` from full PEFT-layout tensors (keys as `peft_key`)."""
        spec = self.adapters[name].spec
        expected = {s.peft_key(p, w) for s in self.sites if name in s.adapters
                    for p in s.parts if p in spec.target_modules for w in "AB"}
        peers = {key for s in self.sites if name in s.adapters and isinstance(s, ExpertLoraSite)
                 for key in s.peer_keys(spec)}  # the experts of the other EP ranks (each loads its own)
        missing, extra = (expected | peers) - set(tensors), set(tensors) - expected - peers
        if missing or extra:
            raise KeyError(f"adapter {name!r}: missing {sorted(missing)[:4]} unexpected {sorted(extra)[:4]}")
        for site in self.sites:
            if name in site.adapters:
                site.from_hf(name, spec, tensors)

    def grad_norm(self, name: str) -> torch.Tensor:
        """Global L2 norm of adapter `name`'s gradients over all TP shards and EP ranks' experts (collective over TP,
        and over EP with expert parallelism)."""
        device = self.sites[0].module.weight.device
        # squares summed: [TP-sharded, TP-replicated] x [dense or local to the EP group, this EP rank's experts]
        sums = torch.zeros(2, 2, dtype=torch.float64, device=device)
        for site in self.sites:
            adapter = site.adapters.get(name)
            if adapter is None:
                continue
            for p in (adapter.lora_A, adapter.lora_B):
                if p.grad is not None:
                    sums[0 if p.tp_sharded else 1, int(getattr(p, "expert_parallel", False))] += \
                        p.grad.detach().double().pow(2).sum()
        if dist.get_world_size(self.tp_group) > 1:
            dist.all_reduce(sums[0], group=self.tp_group)
        if self.ep_group is not None and dist.get_world_size(self.ep_group) > 1:
            experts = sums[:, 1].contiguous()
            dist.all_reduce(experts, group=self.ep_group)
            sums[:, 1] = experts
        return sums.sum().sqrt()

    def close(self) -> None:
        for site in self.sites:
            site.close()
        self.adapters.clear()

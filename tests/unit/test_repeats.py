"""A stack's identical blocks traced once and copied: the same graph, regions and plan as tracing every call."""
import pytest
import torch
import transformers
from torch import nn
from torch.utils._pytree import tree_map

from xla_tp.dataflow.graph import Value
from xla_tp.dataflow.regions import explored
from xla_tp.dataflow.repeats import structures
from xla_tp.dataflow.trace import trace
from xla_tp.planners import plan_for
from xla_tp.zoo.registry import build

pytestmark = pytest.mark.core

SIZES = {"data": 2, "model": 4}


class Unstacked(nn.Module):
    """Two MLP blocks held as attributes: no stack to copy from."""

    def __init__(self, h: int = 32):
        super().__init__()
        self.embed = nn.Embedding(64, h)
        self.up1, self.down1 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.up2, self.down2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.head = nn.Linear(h, 64)

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.down1(torch.relu(self.up1(x)))
        x = x + self.down2(torch.relu(self.up2(x)))
        return self.head(x)


class Block(nn.Module):
    """An MLP block whose forward reads a setting the structure does not compare (a dict)."""

    def __init__(self, h: int, whole: bool):
        super().__init__()
        self.settings = {"whole": whole}
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x, whole=None):
        hidden = self.up(torch.nn.functional.layer_norm(x, x.shape[-1:]))
        if self.settings["whole"] if whole is None else whole:  # a norm over the hidden features: nothing splits this block
            hidden = torch.nn.functional.layer_norm(hidden, hidden.shape[-1:])
        return x + self.down(torch.relu(hidden))


class Stack(nn.Module):
    def __init__(self, whole: list[bool], h: int = 32, called: tuple[int, ...] = ()):
        super().__init__()
        self.embed = nn.Embedding(64, h)
        self.blocks = nn.ModuleList(Block(h, w) for w in whole)
        self.called = called  # blocks called with whole=True

    def forward(self, ids):
        x = self.embed(ids)
        for i, block in enumerate(self.blocks):
            x = block(x, whole=True) if i in self.called else block(x)
        return x


def deepseek_v3():
    """DeepSeek-V3's shape: one dense layer, then MoE layers (``first_k_dense_replace``)."""
    config = transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=128)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


MODELS = {
    # name: (the model, how many blocks are copies: of each structure, all but the first and the last)
    "llama": (lambda: build("llama", layers=6, kv_heads=2), 4),
    "gemma2": (lambda: build("gemma2", layers=9), 3 + 2),  # sliding, full, sliding, ...: two structures
    "gemma3": (lambda: build("gemma3", layers=8), 5),  # five sliding, one full, two sliding
    "deepseek_v3": (deepseek_v3, 3),  # the dense first layer alone, five MoE layers
    "gpt2": (lambda: build("gpt2", layers=5), 3),
    "bert": (lambda: build("bert", layers=5), 3),
    "titan_llama": (lambda: build("titan_llama", layers=5), 3),  # layers in a ModuleDict
    "unstacked": (lambda: Unstacked().eval(), 0),
}


def graph_key(graph) -> tuple:
    """The whole graph by indices: nodes, values, who reads what, callers, outputs, parameters."""
    rel = lambda a: ("value", a.index) if isinstance(a, Value) else a  # noqa: E731
    nodes = [(n.index, n.op, n.func, n.module, repr(tree_map(rel, (n.args, n.kwargs))),
              [v.index for v in n.tensors], [v.index for v in n.outputs]) for n in graph.nodes]
    values = [(v.index, v.shape, v.dtype, v.kind, v.name, v.dynamic, v.producer.index if v.producer else None,
               [(n.index, pos) for n, pos in v.consumers]) for v in graph.values]
    return (nodes, values, sorted((k, sorted(v)) for k, v in graph.callers.items()), [v.index for v in graph.outputs],
            {k: v.index for k, v in graph.params.items()})


def region_key(r) -> tuple:
    return (r.projection.node.index, list(r.values.items()), [(k, n.index, p.index, d) for k, (n, p, d) in r.rows.items()],
            r.stop, r.stop_node.index if r.stop_node else None, r.reaches_output, r.attention,
            {k: n.index for k, n in r.granules.items()}, r.windows, r.slicers, r.merges, list(r.ends.items()),
            list(r.reductions), r.row_windows, r.copied, r.granule_windows)


def plan_key(plan, model) -> tuple:
    roles = {n: (r.kind, r.axes, r.why, r.natural, r.packing) for n, r in plan.roles.items()}
    return (dict(plan), roles, plan.replicated, plan.packings, plan.slicers, [repr(c) for c in plan.choices],
            plan.whole_attention, plan.blocks, plan.explain(model))


@pytest.mark.parametrize("name", list(MODELS))
def test_copied_blocks_give_the_plan_of_every_call_traced(name):
    build_model, copies = MODELS[name]
    torch.manual_seed(0)
    model = build_model()
    fast, full = trace(model), trace(model, repeats=False)
    assert len(fast.copies) == copies and not full.copies
    assert graph_key(fast) == graph_key(full)
    assert [region_key(r) for r in explored(fast)] == [region_key(r) for r in explored(full)]
    assert plan_key(plan_for(model, SIZES, graph=fast), model) == plan_key(plan_for(model, SIZES, graph=full), model)


def test_blocks_that_compute_differently_are_different_structures():
    gemma = build("gemma3", layers=8)  # layer 5 is full attention, the others sliding
    found = structures(gemma)
    assert found["model.layers.0"] == found["model.layers.7"] and "model.layers.5" not in found
    deepseek = structures(deepseek_v3())
    assert "model.layers.0" not in deepseek and len({deepseek[f"model.layers.{i}"] for i in range(1, 6)}) == 1
    llama = build("llama", layers=4)
    llama.model.layers[2].forward = llama.model.layers[2].forward  # a forward set on one block
    assert "model.layers.2" not in structures(llama) and "model.layers.3" in structures(llama)
    block = lambda: nn.Sequential(nn.ModuleList(nn.Linear(4, 4) for _ in range(3)), nn.Linear(4, 4))  # noqa: E731
    assert structures(nn.Sequential(*(block() for _ in range(3)))) == {"0": 0, "1": 0, "2": 0}  # not their insides
    wrapped = nn.Sequential(nn.Embedding(8, 4), nn.ModuleList(nn.Linear(4, 4) for _ in range(3)), nn.Linear(4, 8))
    assert structures(wrapped) == {"1.0": 0, "1.1": 0, "1.2": 0}  # a stack inside a stack of different blocks


@pytest.mark.parametrize("whole", [[True, False, False, False, False], [False, False, False, False, True]],
                         ids=["first-differs", "last-differs"])
def test_a_block_that_does_something_else_is_traced_itself(whole):
    """The structure cannot see the dict setting; the check of the last call against the first does: every
    call is recorded again, and the plan is the full trace's."""
    model = Stack(whole).eval()
    assert len(set(structures(model).values())) == 1
    fast, full = trace(model), trace(model, repeats=False)
    assert not fast.copies and graph_key(fast) == graph_key(full)
    plan = plan_for(model, SIZES, graph=fast)
    assert plan_key(plan, model) == plan_key(plan_for(model, SIZES, graph=full), model)
    split = [i for i, w in enumerate(whole) if plan.roles.get(f"blocks.{i}.up.weight")]
    assert split == [i for i, w in enumerate(whole) if not w]


def test_a_stack_of_equal_blocks_is_copied():
    model = Stack([False] * 5).eval()
    graph = trace(model)
    assert [(c.source, c.target) for c in graph.copies] == [("blocks.0", f"blocks.{i}") for i in (1, 2, 3)]
    assert graph_key(graph) == graph_key(trace(model, repeats=False))


def test_a_block_called_with_other_arguments_is_traced_itself():
    model = Stack([False] * 5, called=(2,)).eval()
    graph = trace(model)
    assert [c.target for c in graph.copies] == ["blocks.1", "blocks.3"]
    assert graph_key(graph) == graph_key(trace(model, repeats=False))
    plan = plan_for(model, SIZES, graph=graph)
    assert [i for i in range(5) if plan.roles.get(f"blocks.{i}.up.weight")] == [0, 1, 3, 4]


def test_a_plan_on_another_mesh_from_the_same_trace_is_the_plan_from_scratch():
    """The roles of a model axis size are kept with the trace; a plan that changes its own (experts replicated)
    leaves them as they were for the next."""
    model = deepseek_v3()
    first = plan_for(model, {"model": 4}, experts="replicated")
    again = plan_for(model, {"data": 2, "model": 4}, graph=first.graph)
    fresh = plan_for(model, {"data": 2, "model": 4})
    assert first.roles["model.layers.1.mlp.experts.down_proj"] != fresh.roles["model.layers.1.mlp.experts.down_proj"]
    assert plan_key(again, model) == plan_key(fresh, model)

"""BERT / RoBERTa encoders (and MLM heads): Megatron layout.

Recognised by ``attention.self.{query,key,value}`` and ``attention.output.dense`` Linears.
q/k/v and ``intermediate.dense`` column-parallel, ``attention.output.dense`` and the layer's
``output.dense`` row-parallel (the longest suffix wins, so the two ``output.dense`` differ);
``word_embeddings`` vocab-parallel, the MLM ``decoder`` (tied to it) column-parallel with
vocab-sharded logits; position/type embeddings, norms and the pooler replicated. Example::

    plan = plan(BertModel(cfg), tp=4)
    plan["encoder.layer.*.attention.self.query"]    # ColwiseParallel()
"""
from __future__ import annotations

from torch import nn

from .plan import Plan
from .prepare import prepare_for_xla
from .structure import config_heads, has
from .table import build_plan

FAMILY = "bert"
TABLE = (
    ("word_embeddings", "vocab"),
    ("attention.self.query", "col_heads"), ("attention.self.key", "col_heads"),
    ("attention.self.value", "col_heads"), ("attention.output.dense", "row_heads"),
    ("intermediate.dense", "col"), ("output.dense", "row"),
    ("predictions.decoder", "head"), ("lm_head.decoder", "head"),
)


def detect(model: nn.Module) -> bool:
    """Self-attention q/k/v and an attention output projection, all ``nn.Linear``."""
    return all(has(model, s, nn.Linear) for s in ("attention.self.query", "attention.output.dense"))


def plan(model: nn.Module, tp: int) -> Plan:
    """The Megatron plan for a BERT-like encoder on a model axis of size ``tp``."""
    return build_plan(model, TABLE, tp, FAMILY, heads=config_heads(model), prepare=prepare_for_xla)

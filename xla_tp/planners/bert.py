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

from .prepare import prepare_for_xla
from .table import LinearFamily

TABLE = (
    ("word_embeddings", "vocab"),
    ("attention.self.query", "col_heads"), ("attention.self.key", "col_heads"),
    ("attention.self.value", "col_heads"), ("attention.output.dense", "row_heads"),
    ("intermediate.dense", "col"), ("output.dense", "row"),
    ("predictions.decoder", "head"), ("lm_head.decoder", "head"),
)

FAMILY = LinearFamily("bert", TABLE, probes=("attention.self.query", "attention.output.dense"),
                      prepare=prepare_for_xla)
detect, plan = FAMILY.detect, FAMILY.plan

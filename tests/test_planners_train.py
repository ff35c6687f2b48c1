"""One "auto" training step of every decoder family (some with GQA: 2 key/value heads < 4 devices)
matches CPU."""
import copy

import pytest
import torch
import torch.nn.functional as F
import torch_xla

import xla_tp
from xla_tp.zoo.registry import VOCAB, build, run

from .helpers import collective_counts, max_err


def _loss(model, tokens):
    logits = run(model, tokens)
    return logits, F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


@pytest.mark.parametrize("name,kv", [("llama", 2), ("qwen3", 8), ("titan_llama", 2), ("mistral", 2), ("qwen2", 8),
                                     ("gemma", 8), ("gemma2", 2), ("granite", 8), ("cohere", 8)])
def test_auto_training_step_matches_cpu(name, kv):
    torch.manual_seed(0)
    ref = build(name, kv_heads=kv).train()
    model = copy.deepcopy(ref)
    xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(data=2, model=4))
    tokens = torch.randint(0, VOCAB, (4, 16))
    logits, loss = _loss(model, tokens.to(next(model.parameters()).device))
    counts = collective_counts([logits])
    assert counts.get("all-gather", 0) == 0 and counts.get("all-reduce", 0) <= 6, counts
    ref_logits, ref_loss = _loss(ref, tokens)
    for m, lo in ((model, loss), (ref, ref_loss)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)  # AdamW step 1 is sign(grad): amplifies 1e-7 noise
        lo.backward()
        opt.step()
    torch_xla.sync()
    assert max_err(logits, ref_logits) < 1e-4 and max_err(loss, ref_loss) < 1e-4
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert max_err(p, q) < 1e-4, n

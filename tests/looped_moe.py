"""MoE models that loop over per-expert modules and pick each expert's tokens with ``torch.where``
(the eager form, as transformers 4.x's Mixtral, transformers 5.x's expert-hit loops and most hand-written
MoEs are): tiny, for tests."""
import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, INTER, EXPERTS, TOP_K, VOCAB = 32, 64, 8, 2, 64


class ExpertMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(HIDDEN, INTER, bias=False), nn.Linear(HIDDEN, INTER, bias=False)
        self.w2 = nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class OneHotMoe(nn.Module):
    """transformers 4.x's Mixtral block: a one-hot expert mask, ``hidden[None, top_x]``, in-place index_add_."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(ExpertMLP() for _ in range(EXPERTS))

    def forward(self, hidden):
        b, s, h = hidden.shape
        hidden = hidden.view(-1, h)
        weights, chosen = torch.topk(F.softmax(self.gate(hidden), dim=1, dtype=torch.float), TOP_K, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(hidden.dtype)
        out = torch.zeros((b * s, h), dtype=hidden.dtype, device=hidden.device)
        mask = F.one_hot(chosen, num_classes=EXPERTS).permute(2, 1, 0)
        for e in range(EXPERTS):
            idx, top_x = torch.where(mask[e])
            y = self.experts[e](hidden[None, top_x].reshape(-1, h)) * weights[top_x, idx, None]
            out.index_add_(0, top_x, y.to(hidden.dtype))
        return out.reshape(b, s, h)


class EqualsMoe(OneHotMoe):
    """``token, choice = (ids == e).nonzero(as_tuple=True)``, ``x[token]``, index_add out of place."""

    def forward(self, hidden):
        x = hidden.flatten(0, 1)
        weights, ids = torch.topk(self.gate(x).softmax(-1), TOP_K)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, choice = (ids == e).nonzero(as_tuple=True)
            out = out.index_add(0, token, expert(x[token]) * weights[token, choice, None])
        return out.view_as(hidden)


class AddAssignMoe(OneHotMoe):
    """mistral-inference's ``MoeLayer``: ``results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(...)``."""

    def forward(self, hidden):
        x = hidden.reshape(-1, hidden.shape[-1])
        weights, chosen = torch.topk(self.gate(x), TOP_K)
        weights = F.softmax(weights, dim=1, dtype=torch.float).to(x.dtype)
        results = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            batch_idx, nth_expert = torch.where(chosen == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(x[batch_idx])
        return results.view_as(hidden)


class HitLoopMoe(OneHotMoe):
    """transformers 5.x's SwitchTransformers, NLLB-MoE and LongCat-Flash: a loop over only the experts some
    token chose, ``for e in (mask.sum(...) > 0).nonzero():``, the expert picked by the index's value."""

    def forward(self, hidden):
        x = hidden.flatten(0, 1)
        weights, chosen = torch.topk(self.gate(x).softmax(-1), TOP_K)
        out = torch.zeros_like(x)
        mask = F.one_hot(chosen, num_classes=EXPERTS).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            idx, top_x = torch.where(mask[e].squeeze(0))
            y = self.experts[int(e[0])](x[None, top_x].reshape(-1, x.shape[-1])) * weights[top_x, idx, None]
            out.index_add_(0, top_x, y)
        return out.view_as(hidden)


class HitEqualsMoe(OneHotMoe):
    """The same loop with each expert's tokens picked by ``torch.where(ids == e[0])`` (transformers 4.x's gpt-oss)."""

    def forward(self, hidden):
        x = hidden.flatten(0, 1)
        weights, ids = torch.topk(self.gate(x).softmax(-1), TOP_K)
        out = torch.zeros_like(x)
        hit = torch.greater(F.one_hot(ids, num_classes=EXPERTS).sum(dim=(0, 1)), 0).nonzero()
        for e in self.chosen(hit):
            token, choice = torch.where(ids == e[0])
            out.index_add_(0, token, self.experts[e](x[token]) * weights[token, choice, None])
        return out.view_as(hidden)

    def chosen(self, hit):
        return hit


class Decoder(nn.Module):
    def __init__(self, moe: type, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norms = nn.ModuleList(nn.LayerNorm(HIDDEN) for _ in range(layers))
        self.moes = nn.ModuleList(moe() for _ in range(layers))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return self.head(x)


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(seed))

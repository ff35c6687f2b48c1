"""Split features through ops the gated delta net runs (no torch_xla): a concatenation read channel by channel
and split back into its pieces (``dataflow.concats``), a triangular solve per head, writes of one chunk at a
time; and where each stops."""
import torch
import torch.nn.functional as F

from xla_tp.planners import plan_for

SIZES = {"model": 4}


class Mixer(torch.nn.Module):
    """q, k, v per group out of one projection, concatenated, convolved per channel, split back."""

    def __init__(self, reader: str = "split"):
        super().__init__()
        self.reader = reader
        self.qkv = torch.nn.Linear(16, 96, bias=False)  # 4 groups of [q 8 | k 8 | v 8]
        self.conv = torch.nn.Conv1d(96, 96, 3, groups=96, padding=2, bias=False)
        self.out = torch.nn.Linear(32, 16, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 96))

    def forward(self, x):
        q, k, v = self.qkv(x).view(*x.shape[:2], 4, 24).split([8, 8, 8], -1)
        mixed = torch.cat([t.reshape(*x.shape[:2], 32) for t in (q, k, v)], -1)
        mixed = F.silu(self.conv(mixed.transpose(1, 2))[..., :x.shape[1]]).transpose(1, 2)
        if self.reader == "sum":
            return self.out(mixed[..., :32]) + mixed.sum(-1, keepdim=True)
        if self.reader == "scaled":  # one value per channel, in the original order
            mixed = mixed * self.scale
        if self.reader == "halves":
            q, rest = mixed.split([48, 48], -1)
            return self.out(q[..., :32] * rest[..., :32])
        q, k, v = mixed.split([32, 32, 32], -1)
        return self.out(q * k * v)


def test_a_concatenation_split_back_into_its_pieces_is_laid_device_major():
    plan = plan_for(Mixer(), mesh=SIZES, example_inputs=(torch.zeros(2, 5, 16),))
    assert plan.roles["qkv.weight"].kind == "column" and plan.roles["out.weight"].kind == "row"
    assert plan.roles["conv.weight"].packing.blocks == ((0, 32), (32, 32), (64, 32))
    assert plan.tagged_concats == {(32, 32, 32)}


def test_a_concatenation_read_across_its_channels_scaled_per_channel_or_split_elsewhere_stops():
    for reader in ("sum", "halves", "scaled"):
        plan = plan_for(Mixer(reader), mesh=SIZES, example_inputs=(torch.zeros(2, 5, 16),))
        assert "qkv.weight" in plan.replicated and "'cat'" in plan.replicated["qkv.weight"], reader
        assert not plan.tagged_concats


class Chunks(torch.nn.Module):
    """Per head: a triangular solve per chunk, its result written one chunk at a time."""

    def __init__(self, write: str = "chunk"):
        super().__init__()
        self.write = write
        self.proj = torch.nn.Linear(16, 32, bias=False)  # 4 heads of 8
        self.out = torch.nn.Linear(32, 16, bias=False)

    def forward(self, x):
        h = self.proj(x).view(2, 2, 4, 4, 8).permute(0, 3, 1, 2, 4)  # [B, H, chunks, C, D]
        upper = torch.ones(4, 4, dtype=torch.bool).triu()
        a = (h @ h.transpose(-1, -2)).masked_fill(upper, 0) + torch.eye(4)
        solved = torch.linalg.solve_triangular(a, h, upper=False, unitriangular=True)
        out = torch.zeros_like(solved)
        for i in range(2):
            out[:, :, i] = solved[:, :, i] * 2
        if self.write == "heads":
            out[:, 1:, 0] = 0
        return self.out(out.permute(0, 2, 3, 1, 4).reshape(2, 8, 32))


def test_a_triangular_solve_per_head_and_writes_per_chunk_keep_the_heads_split():
    plan = plan_for(Chunks(), mesh=SIZES, example_inputs=(torch.zeros(2, 8, 16),))
    assert plan.roles["proj.weight"].kind == "column" and plan.roles["out.weight"].kind == "row"


def test_a_write_into_part_of_the_heads_stops():
    plan = plan_for(Chunks("heads"), mesh=SIZES, example_inputs=(torch.zeros(2, 8, 16),))
    assert "part of its sharded dimension" in plan.replicated["proj.weight"]

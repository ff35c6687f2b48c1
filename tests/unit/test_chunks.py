"""Attention one chunk at a time (``dataflow.chunks``), and a vision tower whose grid the model reads on the host
planned from made-up images (``dataflow.inputs``: Qwen2-VL's, Qwen2.5-VL's; the grid kept real in the trace)."""
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from xla_tp.dataflow.chunks import per_chunk_attention
from xla_tp.dataflow.trace import trace
from xla_tp.planners import plan_for

pytestmark = pytest.mark.core


class PerChunk(nn.Module):
    """Attention within each chunk of a sequence, chunks from a grid's values (as Qwen2-VL's tower does)."""

    def __init__(self, concatenated: bool = True):
        super().__init__()
        self.qkv, self.proj, self.concatenated = nn.Linear(32, 96), nn.Linear(32, 32), concatenated

    def forward(self, x, lengths):
        q, k, v = self.qkv(x).view(1, -1, 3, 4, 8).permute(2, 0, 3, 1, 4).unbind(0)
        chunks = zip(*(t.split(lengths, dim=2) for t in (q, k, v)))
        outs = [F.scaled_dot_product_attention(*c).transpose(1, 2) for c in chunks]
        out = torch.cat(outs, dim=1) if self.concatenated else sum(o.sum(1, keepdim=True) for o in outs)
        return self.proj(out.reshape(-1, 32) if self.concatenated else out.reshape(-1, 32))


def test_found_by_what_its_chunks_meet():
    x = torch.randn(12, 32)
    assert per_chunk_attention(trace(PerChunk(), (x, [4, 8]))) == {""}
    assert per_chunk_attention(trace(PerChunk(concatenated=False), (x, [4, 8]))) == set()  # summed: not chunks


TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4,
            vocab_size=128, max_position_embeddings=128, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
TOKENS = dict(image_token_id=127, video_token_id=126, vision_start_token_id=125, vision_end_token_id=124)


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
def test_a_tower_of_flattened_patches_is_planned_with_no_example_input(name):
    vision = dict(depth=2, hidden_size=64, num_heads=8, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    if name == "qwen2_vl":
        config = transformers.Qwen2VLConfig(text_config=TEXT, vision_config=dict(vision, embed_dim=64, mlp_ratio=2),
                                            **TOKENS)
        model, mlp = transformers.Qwen2VLForConditionalGeneration(config), ("fc1", "fc2")
    else:
        vision.update(out_hidden_size=64, intermediate_size=128, window_size=16, fullatt_block_indexes=[1])
        config = transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=vision, **TOKENS)
        model, mlp = transformers.Qwen2_5_VLForConditionalGeneration(config), ("up_proj", "down_proj")
    plan = plan_for(model, {"data": 2, "model": 4})
    for fqn, kind in [("blocks.0.attn.qkv", "column"), ("blocks.1.attn.proj", "row"), (f"blocks.0.mlp.{mlp[0]}",
                      "column"), (f"blocks.1.mlp.{mlp[1]}", "row"), ("merger.mlp.0", "column"), ("merger.mlp.2", "row")]:
        assert plan.roles[f"model.visual.{fqn}.weight"].kind == kind, (fqn, plan.roles.get(f"model.visual.{fqn}.weight"))
    assert plan.roles["model.visual.patch_embed.proj.weight"].axes[2:4] == (None, "kernel")  # its rows: 4 divide them

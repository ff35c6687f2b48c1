"""The suite's tiny Hugging Face models (2 layers, 8 heads, hidden 64): a grouped-query Llama (``tiny_llama``, also
the ``tiny_llama`` fixture), and encoders and vision models, each with the inputs its users pass by keyword: what the
suite calls as a user does."""
from __future__ import annotations

import torch
import transformers as T

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
             vocab_size=128, max_position_embeddings=128)
SIZE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, intermediate_size=128)
VISION = dict(SIZE, image_size=32, patch_size=8)


def tiny_llama(seed: int = 0, **overrides) -> T.LlamaForCausalLM:
    """``LlamaForCausalLM`` on ``LLAMA`` (``overrides`` replace its entries), initialised from ``seed``."""
    torch.manual_seed(seed)
    return T.LlamaForCausalLM(T.LlamaConfig(**{**LLAMA, **overrides}))


def _text(vocab: int = 64) -> dict[str, torch.Tensor]:
    ids = torch.randint(4, vocab - 2, (4, 16))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _pixels() -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(4, 3, 32, 32)}


BUILDERS = {
    "esm": lambda: (T.EsmModel(T.EsmConfig(vocab_size=33, pad_token_id=1, max_position_embeddings=64, **SIZE),
                               add_pooling_layer=False), _text(33)),
    "vit": lambda: (T.ViTModel(T.ViTConfig(**VISION), add_pooling_layer=False), _pixels()),
    "clip_vision": lambda: (T.CLIPVisionModel(T.CLIPVisionConfig(**VISION)), _pixels()),
    "siglip_vision": lambda: (T.SiglipVisionModel(T.SiglipVisionConfig(**VISION)), _pixels()),
    "modernbert": lambda: (T.ModernBertModel(T.ModernBertConfig(vocab_size=64, pad_token_id=0, bos_token_id=1,
                                                                eos_token_id=2, cls_token_id=1, sep_token_id=2,
                                                                **SIZE)), _text()),
    "bert": lambda: (T.BertModel(T.BertConfig(vocab_size=64, **SIZE), add_pooling_layer=False),
                     {**_text(), "token_type_ids": torch.zeros(4, 16, dtype=torch.long)}),
}


def tiny_llava(seed: int = 0) -> tuple[T.LlavaForConditionalGeneration, dict[str, torch.Tensor]]:
    """A Llava (CLIP tower of ``VISION``, Llama of ``LLAMA``) in eval mode, and an image call by keyword: 4 images,
    each taking the 16 placeholder tokens its 16 patches fill (CLS dropped), in 24 tokens."""
    torch.manual_seed(seed)
    image = LLAMA["vocab_size"] - 1
    model = T.LlavaForConditionalGeneration(T.LlavaConfig(
        vision_config=T.CLIPVisionConfig(**VISION), text_config=T.LlamaConfig(**LLAMA), image_token_id=image))
    ids = torch.randint(4, image, (4, 24))
    ids[:, 2:18] = image
    return model.eval(), {"input_ids": ids, **_pixels()}


def tiny_gemma3_vl(seed: int = 0) -> tuple[T.Gemma3ForConditionalGeneration, dict[str, torch.Tensor]]:
    """A Gemma 3 (SigLIP tower of ``VISION``, a Gemma 3 text model of ``LLAMA``'s sizes, head dim 8) in eval mode, and
    an image call by keyword as its processor makes it: 4 images, each pooled to 4 placeholder tokens in 12,
    ``token_type_ids``."""
    torch.manual_seed(seed)
    image = LLAMA["vocab_size"] - 1
    text = T.Gemma3TextConfig(**LLAMA, head_dim=8)
    model = T.Gemma3ForConditionalGeneration(T.Gemma3Config(
        vision_config=T.SiglipVisionConfig(**VISION), text_config=text, mm_tokens_per_image=4, image_token_index=image,
        boi_token_index=image - 2, eoi_token_index=image - 3))
    ids = torch.randint(4, image - 3, (4, 12))
    ids[:, 2:6] = image
    return model.eval(), {"input_ids": ids, **_pixels(), "token_type_ids": (ids == image).long()}


def tiny_qwen_vl(version: str = "2", seed: int = 0) -> tuple[T.PreTrainedModel, dict[str, torch.Tensor]]:
    """A Qwen2-VL or (``version`` "2.5") Qwen2.5-VL (its own tower: 2 blocks of 8 heads, 4x4 patches of 2 frames,
    merged 2x2; 2.5's first block attends within windows of 2x2 merged patches; a Qwen2 of ``LLAMA`` with M-RoPE)
    in eval mode, and an image call by keyword as its processor makes it: 4 images of 4x4 patches (``pixel_values``
    flattened, ``image_grid_thw``), each taking 4 placeholder tokens in 16, ``mm_token_type_ids``."""
    torch.manual_seed(seed)
    image = LLAMA["vocab_size"] - 1
    text = dict(LLAMA, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    vision = dict(depth=2, hidden_size=64, num_heads=8, patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                  in_channels=3)
    tokens = dict(image_token_id=image, video_token_id=image - 1, vision_start_token_id=image - 2,
                  vision_end_token_id=image - 3)
    if version == "2":
        model = T.Qwen2VLForConditionalGeneration(T.Qwen2VLConfig(
            text_config=text, vision_config=dict(vision, embed_dim=64, mlp_ratio=2), **tokens))
    else:
        model = T.Qwen2_5_VLForConditionalGeneration(T.Qwen2_5_VLConfig(text_config=text, vision_config=dict(
            vision, out_hidden_size=64, intermediate_size=128, window_size=16, fullatt_block_indexes=[1]), **tokens))
    ids = torch.randint(4, image - 3, (4, 16))
    ids[:, 1], ids[:, 2:6], ids[:, 6] = image - 2, image, image - 3
    return model.eval(), {"input_ids": ids, "pixel_values": torch.randn(4 * 16, 3 * 2 * 4 * 4),
                          "image_grid_thw": torch.tensor([[1, 4, 4]] * 4), "mm_token_type_ids": (ids == image).int()}


def build(name: str, seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """``(model in eval mode, its inputs by keyword)`` on the CPU, the same for a seed."""
    torch.manual_seed(seed)
    model, inputs = BUILDERS[name]()
    return model.eval(), inputs

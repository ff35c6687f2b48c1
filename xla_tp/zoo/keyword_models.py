"""Tiny models whose users call them by keyword, each built with the call its users make.

Encoders (``ENCODERS``: ESM, ViT, CLIP's and SigLIP's vision towers, ModernBERT, BERT) on their tokens or
pixels. Vision-language models measured on an image call (``pixel_values`` and ``input_ids`` holding the image's
placeholder tokens, as their processors make them): Llava, Gemma 3, Qwen2-VL and Qwen2.5-VL. Diffusion
transformers (diffusers) on a denoising call (latents ``hidden_states``, ``encoder_hidden_states``,
``timestep``, and what each adds: SD3's and Flux's ``pooled_projections``, Flux's ``img_ids`` and
``txt_ids``): SD3, PixArt, Flux. Sizes as ``xla_tp.zoo.registry``'s tiny width: 2 layers, 8 heads, hidden
64 (a batch of 4). Built on the CPU from configs (no hub download), the same for a seed. Example::

    model, inputs = build("llava")
    logits = model(**inputs).logits          # [4, 24, 128]
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
             vocab_size=128, max_position_embeddings=128)
SIZE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, intermediate_size=128)
VISION = dict(SIZE, image_size=32, patch_size=8)
IMAGE_TOKEN = LLAMA["vocab_size"] - 1  # the placeholder an image's features replace

Call = tuple[nn.Module, dict[str, torch.Tensor]]


def _pixels() -> dict[str, torch.Tensor]:
    """4 RGB images of ``VISION``'s size: ``{"pixel_values": [4, 3, 32, 32]}``."""
    return {"pixel_values": torch.randn(4, 3, 32, 32)}


def _text(vocab: int = 64) -> dict[str, torch.Tensor]:
    ids = torch.randint(4, vocab - 2, (4, 16))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def encoder(name: str) -> Call:
    """One of ``ENCODERS`` (no pooling head), and its call on 4 sequences of 16 tokens or 4 images."""
    import transformers as T
    calls = {
        "esm": lambda: (T.EsmModel(T.EsmConfig(vocab_size=33, pad_token_id=1, max_position_embeddings=64, **SIZE),
                                   add_pooling_layer=False), _text(33)),
        "vit": lambda: (T.ViTModel(T.ViTConfig(**VISION), add_pooling_layer=False), _pixels()),
        "clip_vision": lambda: (T.CLIPVisionModel(T.CLIPVisionConfig(**VISION)), _pixels()),
        "siglip_vision": lambda: (T.SiglipVisionModel(T.SiglipVisionConfig(**VISION)), _pixels()),
        "modernbert": lambda: (T.ModernBertModel(T.ModernBertConfig(
            vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, **SIZE)),
            _text()),
        "bert": lambda: (T.BertModel(T.BertConfig(vocab_size=64, **SIZE), add_pooling_layer=False),
                         {**_text(), "token_type_ids": torch.zeros(4, 16, dtype=torch.long)}),
    }
    return calls[name]()


def llava() -> Call:
    """A Llava (CLIP tower of ``VISION``, Llama of ``LLAMA``), and an image call: 4 images, each taking the 16
    placeholder tokens its 16 patches fill (CLS dropped), in 24 tokens."""
    import transformers as T
    model = T.LlavaForConditionalGeneration(T.LlavaConfig(
        vision_config=T.CLIPVisionConfig(**VISION), text_config=T.LlamaConfig(**LLAMA), image_token_id=IMAGE_TOKEN))
    ids = torch.randint(4, IMAGE_TOKEN, (4, 24))
    ids[:, 2:18] = IMAGE_TOKEN
    return model, {"input_ids": ids, **_pixels()}


def gemma3_vl() -> Call:
    """A Gemma 3 (SigLIP tower of ``VISION``, a Gemma 3 text model of ``LLAMA``'s sizes, head dim 8), and an image
    call as its processor makes it: 4 images, each pooled to 4 placeholder tokens in 12, ``token_type_ids``."""
    import transformers as T
    text = T.Gemma3TextConfig(**LLAMA, head_dim=8)
    model = T.Gemma3ForConditionalGeneration(T.Gemma3Config(
        vision_config=T.SiglipVisionConfig(**VISION), text_config=text, mm_tokens_per_image=4,
        image_token_index=IMAGE_TOKEN, boi_token_index=IMAGE_TOKEN - 2, eoi_token_index=IMAGE_TOKEN - 3))
    ids = torch.randint(4, IMAGE_TOKEN - 3, (4, 12))
    ids[:, 2:6] = IMAGE_TOKEN
    return model, {"input_ids": ids, **_pixels(), "token_type_ids": (ids == IMAGE_TOKEN).long()}


def qwen_vl(version: str = "2") -> Call:
    """A Qwen2-VL or (``version`` "2.5") Qwen2.5-VL (its own tower: 2 blocks of 8 heads, 4x4 patches of 2 frames,
    merged 2x2; 2.5's first block attends within windows of 2x2 merged patches; a Qwen2 of ``LLAMA`` with M-RoPE),
    and an image call as its processor makes it: 4 images of 4x4 patches (``pixel_values`` flattened,
    ``image_grid_thw``), each taking 4 placeholder tokens in 16, ``mm_token_type_ids``."""
    import transformers as T
    image = IMAGE_TOKEN
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
    return model, {"input_ids": ids, "pixel_values": torch.randn(4 * 16, 3 * 2 * 4 * 4),
                   "image_grid_thw": torch.tensor([[1, 4, 4]] * 4), "mm_token_type_ids": (ids == image).int()}


def _denoising(**extra: torch.Tensor) -> dict[str, torch.Tensor]:
    """A denoising call on 4 latents of 4x8x8 with 6 conditioning tokens of 32 features (``extra`` added or replacing)."""
    base = {"hidden_states": torch.randn(4, 4, 8, 8), "encoder_hidden_states": torch.randn(4, 6, 32),
            "timestep": torch.tensor([1.0, 2.0, 3.0, 4.0])}
    return {**base, **extra}


def sd3() -> Call:
    """diffusers' ``SD3Transformer2DModel`` (joint attention over latents and text), its call with pooled text."""
    import diffusers
    return diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=8,
        joint_attention_dim=32, caption_projection_dim=64, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=16), _denoising(pooled_projections=torch.randn(4, 16))


def pixart() -> Call:
    """diffusers' ``PixArtTransformer2DModel`` (cross-attention to the text, adaLN-single), its call."""
    import diffusers
    return diffusers.PixArtTransformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=8,
        cross_attention_dim=64, caption_channels=32, out_channels=8, norm_type="ada_norm_single",
        use_additional_conditions=False), _denoising()


def flux() -> Call:
    """diffusers' ``FluxTransformer2DModel`` (one double-stream block, two single-stream), its call on packed
    latents (16 tokens of 16 channels) with pooled text and the positions of image and text tokens."""
    import diffusers
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=8, num_attention_heads=8,
        joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4)), _denoising(
        hidden_states=torch.randn(4, 16, 16), pooled_projections=torch.randn(4, 16), img_ids=torch.randn(16, 3),
        txt_ids=torch.randn(6, 3))


ENCODERS = ("esm", "vit", "clip_vision", "siglip_vision", "modernbert", "bert")
BUILDERS: dict[str, Callable[[], Call]] = {
    **{name: functools.partial(encoder, name) for name in ENCODERS},
    "llava": llava, "gemma3_vl": gemma3_vl, "qwen2_vl": qwen_vl, "qwen2_5_vl": lambda: qwen_vl("2.5"),
    "sd3": sd3, "pixart": pixart, "flux": flux,
}


def build(name: str, seed: int = 0) -> Call:
    """``(model in eval mode, its call's inputs by keyword)`` by name (see ``BUILDERS``), on the CPU, the same
    for a seed."""
    if name not in BUILDERS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(BUILDERS))}")
    torch.manual_seed(seed)
    model, inputs = BUILDERS[name]()
    return model.eval(), inputs

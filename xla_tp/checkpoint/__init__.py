"""Checkpoints of parallelized models: sharded save/load that reshards, and Hugging Face export.

Example::

    xla_tp.save_checkpoint("ckpt", model, opt, step=100, keep=3)
    step = xla_tp.load_checkpoint("ckpt", model, opt)     # on any mesh
    xla_tp.export_hf(model, "out")                       # consolidated safetensors + config
"""
from .export import export_hf
from .load import load_checkpoint
from .save import SaveHandle, save_checkpoint

__all__ = ["SaveHandle", "export_hf", "load_checkpoint", "save_checkpoint"]

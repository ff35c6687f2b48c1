"""Everything xla_tp changes outside its own objects: one list, installed while a model needs it.

The lowering of a parallelized forward is not here: it is a mode entered around the modules that own a
rewrite (``lowering.owners``), so torch's functions (``F.linear``, ``torch.matmul``, SDPA, ``x[i]``, ...)
stay torch's own objects. What remains is what no module owns: calls made outside any module, and
behaviours of torch_xla, transformers and torchao that a mode cannot reach.

Each ``Effect`` names its target, the versions it was written for and why it exists. The first
parallelized model takes a lease (``lease()``), which installs every effect whose target is loaded;
when the last lease is released (``unparallelize``, or the model is garbage-collected) every effect
is undone and torch, torch_xla and transformers are exactly as they were. While installed, each
replacement acts only inside a parallelized model's forward or backward (``lowering.scope``) or on
objects xla_tp made (its parameters, its optimizer records); anywhere else it calls the original.
Targets in optional packages (transformers, torchao) are installed once that package is loaded:
``refresh()`` retries them (each new lease and each optimizer step does). Example::

    lease = compat.lease()          # parallelize_xla does this
    installed()                     # ['histc', 'tensor_histc', 'dynamo_bridge', ...]
    lease.release()                 # the last one: every original is back

``SETTINGS`` lists what cannot be undone that way, because what reads it keeps the first value it
read: one entry, what the audit asks torch_xla for at the process's first HLO query.
"""
from __future__ import annotations

import importlib
import logging
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)
Undo = Callable[[], None]

TORCH = "torch 2.9.0"
TORCH_XLA = "torch 2.9.0 / torch_xla 2.9.0"


@dataclass(frozen=True)
class Effect:
    """One change outside xla_tp. ``install()`` applies it and returns its undo, or None when the
    target is not loaded (it is retried later)."""

    name: str
    target: str
    written_for: str
    why: str
    install: Callable[[], Optional[Undo]]


def _loaded(path: str) -> Any:
    """The object at dotted ``path`` if its module is already imported (optional packages are never
    imported here); None otherwise. ``_loaded("torch.Tensor") is torch.Tensor``."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        module = sys.modules.get(".".join(parts[:i]))
        if module is not None:
            obj = module
            for name in parts[i:]:
                obj = getattr(obj, name, None)
                if obj is None:
                    return None
            return obj
    return None


def _implementation(ref: str) -> Callable[..., Any]:
    """``"xla_tp.lowering.entry:sdpa"`` -> that function (imported when first installed)."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def replace(target: str, make: str, loaded: Optional[str] = None) -> Callable[[], Optional[Undo]]:
    """An install that sets ``target`` (``owner.attr``) to ``make(original)``; its undo puts the
    original back, unless someone replaced ours since (then ours stays, with a warning). With ``loaded``,
    only once that module is loaded too (what ``make`` needs: torch_xla for XLA tensors' effects)."""
    owner_path, _, attr = target.rpartition(".")

    def install() -> Optional[Undo]:
        owner = _loaded(owner_path)
        if owner is None or loaded is not None and sys.modules.get(loaded) is None:
            return None
        original = getattr(owner, attr)
        ours = _implementation(make)(original)
        setattr(owner, attr, ours)

        def undo() -> None:
            if getattr(owner, attr) is ours:
                setattr(owner, attr, original)
            else:
                log.warning("xla_tp: %s was replaced again after xla_tp replaced it; left as it is", target)
        return undo
    return install


def call(ref: str, loaded: str) -> Callable[[], Optional[Undo]]:
    """An install done by the function at ``ref`` (it returns its undo, or None when not applicable), once the
    module ``loaded`` is (like ``replace``'s targets: never imported here)."""
    return lambda: _implementation(ref)() if sys.modules.get(loaded) is not None else None


_ENTRY = "xla_tp.lowering.entry"
_REJOIN = "xla_tp.lowering.rejoin"
EFFECTS: tuple[Effect, ...] = (
    Effect("histc", "torch.histc", TORCH_XLA,
           "XLA has no histogram of integers: MoE auxiliary losses count expert choices with it in the model's own "
           "forward or in the user's loss code, outside any module that could own the call; inside a parallelized "
           "model, XLA tensors are counted by comparisons of static shape", replace("torch.histc", f"{_ENTRY}:histc")),
    Effect("tensor_histc", "torch.Tensor.histc", TORCH_XLA, "as histc", replace("torch.Tensor.histc", f"{_ENTRY}:histc")),
    Effect("masked_scatter", "torch.Tensor.masked_scatter", TORCH_XLA,
           "torch_xla lowers it through nonzero, whose dynamic shape GSPMD refuses on a batch split over devices; "
           "multimodal models put image features in place with it in their own forward, reached only by an image "
           "call: inside a parallelized model XLA tensors are placed in static shapes",
           replace("torch.Tensor.masked_scatter", f"{_ENTRY}:masked_scatter")),
    Effect("tensor_unbind", "torch.Tensor.unbind", TORCH_XLA,
           "multimodal models cut their image features per image (list(features), torch.split) and concatenate "
           "them again, in their own forward; GSPMD moves the pieces of a batch split over data between devices "
           "to concatenate them: inside a parallelized model the pieces of an XLA tensor are remembered",
           replace("torch.Tensor.unbind", f"{_REJOIN}:cut")),
    Effect("tensor_split", "torch.Tensor.split", TORCH_XLA, "as tensor_unbind", replace("torch.Tensor.split", f"{_REJOIN}:cut")),
    Effect("cat", "torch.cat", TORCH_XLA,
           "as tensor_unbind: inside a parallelized model, all the pieces of one XLA tensor, in order, along dimension 0, "
           "are that tensor", replace("torch.cat", f"{_REJOIN}:joined")),
    Effect("dynamo_bridge", "torch_xla._dynamo.dynamo_bridge.extract_graph_helper", TORCH_XLA,
           "the bridge matches graph inputs by an id that SPMD re-stamps, so a compiled backward replays the "
           "first step's inputs; xla_tp matches them by device buffer",
           replace("torch_xla._dynamo.dynamo_bridge.extract_graph_helper", "xla_tp.dynamo:inputs_by_data")),
    Effect("torch_xla_module", "torch.xla", TORCH_XLA,
           "torch.utils.checkpoint replays RNG state through torch.<device>, which torch_xla does not register",
           call("xla_tp.recompute:register", "torch_xla")),
    Effect("optimizer_hooks", "torch.optim.Optimizer step hooks", TORCH_XLA,
           "updates that bitcast (view(dtype)) silently replicate a parameter, and optimizer states get "
           "whatever layout the compiler picks: restored after each step, for parallelized parameters only",
           call("xla_tp.guard:register", "torch_xla")),
    Effect("torchao_rounding", "torchao.optim.adam._fp32_to_bf16_sr", "torchao 0.14.1 / torch_xla 2.9.0",
           "its view(dtype) bitcast executes the pending graph on every call under torch_xla: a lazy "
           "BitcastConvert on XLA tensors keeps the optimizer step one program",
           replace("torchao.optim.adam._fp32_to_bf16_sr", "xla_tp.optim:lazy_rounding", "torch_xla")),
    Effect("experts_interface", "transformers.integrations.moe.ExpertsInterface.get_interface",
           "transformers 5.23.0 / torch_xla 2.9.0",
           "its experts implementations have data-dependent shapes (eager), fail on XLA (grouped_mm: histc on "
           "integers) or copy the expert weights per token (batched_mm); in a parallelized model an experts layer "
           "runs in static slots split as its weights are",
           replace("transformers.integrations.moe.ExpertsInterface.get_interface",
                   "xla_tp.lowering.routed:experts_interface")),
    Effect("attention_interface", "transformers.modeling_utils.AttentionInterface.get_interface",
           "transformers 5.23.0", "a transformers attention module calls its attention function from this registry: "
           "the function runs inside the lowering mode when the module belongs to a parallelized model (its heads "
           "kept visible to the compiler), so the mode sees the attention's few ops, not the whole module's",
           replace("transformers.modeling_utils.AttentionInterface.get_interface",
                   "xla_tp.lowering.owners:attention_interface")),
    Effect("hf_mask_skip", "transformers.masking_utils._ignore_causal_mask_sdpa", "transformers 5.23.0 / torch_xla 2.9.0",
           "it reads the padding mask and the cache's offset on the host to decide whether SDPA may drop the mask; "
           "on XLA each read executes the pending graph, so one forward (a generation step) compiles as three "
           "programs: for XLA tensors the mask is kept, unread", replace("transformers.masking_utils._ignore_causal_mask_sdpa",
                                                                        f"{_ENTRY}:keep_causal_mask")),
    Effect("hf_gqa_sdpa", "transformers.integrations.sdpa_attention.use_gqa_in_sdpa", "transformers 5.23.0",
           "with a mask it has grouped keys and values repeated before SDPA (repeat_kv's reshape merging heads), "
           "which GSPMD lays out with all-to-alls under a context split; xla_tp's SDPA takes the groups with any "
           "mask (True for XLA tensors inside a parallelized forward)",
           replace("transformers.integrations.sdpa_attention.use_gqa_in_sdpa", f"{_ENTRY}:gqa_in_sdpa")),
    Effect("save_pretrained", "transformers.PreTrainedModel.save_pretrained", "transformers 5.23.0 / torch_xla 2.9.0",
           "safetensors reads an XLA tensor's storage pointer and fails; a parallelized model is saved from "
           "host copies", replace("transformers.PreTrainedModel.save_pretrained",
                                  "xla_tp.checkpoint.export:host_save_pretrained", "torch_xla")),
)


@dataclass(frozen=True)
class Setting:
    """A process-wide setting xla_tp makes once and cannot take back (what reads it caches it)."""

    name: str
    target: str
    written_for: str
    why: str
    where: str  # the code that makes it


SETTINGS: tuple[Setting, ...] = (
    Setting("post_optimization_hlo", "XLA_DUMP_POST_OPTIMIZATIONS, as torch_xla reads it at the process's first HLO "
            "query", TORCH_XLA,
            "the audit reads the program torch_xla's own compiler partitions (jaxlib's XLA partitions some programs "
            "differently); when the variable is unset, the audit's first HLO query sets it for that query "
            "(os.environ is as it was after), and every later HLO query of the process returns partitioned programs",
            "xla_tp.auditing.capture:_torch_xla_hlo"),
)

_lock = threading.RLock()
_leases = 0
_undo: dict[str, Undo] = {}


class Lease:
    """One holder's claim on the effects; ``release()`` is idempotent."""

    def __init__(self) -> None:
        self.held = True

    def release(self) -> None:
        global _leases
        with _lock:
            if not self.held:
                return
            self.held = False
            _leases -= 1
            if _leases == 0:
                for name in reversed(list(_undo)):
                    _undo.pop(name)()


def lease() -> Lease:
    """Take a lease: every effect whose target is loaded is installed (once)."""
    global _leases
    with _lock:
        _leases += 1
        refresh()
        return Lease()


def refresh() -> None:
    """Install the effects not installed yet whose targets are now loaded (while a lease is held)."""
    with _lock:
        if _leases == 0:
            return
        for effect in EFFECTS:
            if effect.name not in _undo:
                undo = effect.install()
                if undo is not None:
                    _undo[effect.name] = undo


def installed() -> list[str]:
    """Names of the effects installed now (none once every lease is released)."""
    return list(_undo)

"""HuggingFace's `save_pretrained` on a model shardwise wrapped: it saves the model, or raises saying how.

Two things went wrong with ``model.save_pretrained(dir)`` (the last line of most HuggingFace training scripts, and
what ``push_to_hub`` calls):

* under DDP, ZeRO or FSDP it died with ``RecursionError``: transformers' ``unwrap_model`` follows ``model.module``
  until there is none (torch DDP's wrapper holds the model there), and shardwise wraps in place, so
  ``model.module`` is the model itself (_mixin.MovesRefused);
* under tensor parallel (and any layout that splits parameters) it wrote garbage without an error: the state dict
  holds this rank's pieces answering for the whole shapes, and safetensors copied ``shape`` worth of bytes from each
  piece's ``data_ptr()``, past the end of the piece (a piece's ``data_ptr()`` now raises: sharded_tensor.py);
* on the model given to `sw.parallelize` with pp > 1 it wrote this rank's untrained copies of the layers other
  pipeline ranks train (parallelized_model.py).

`guard_save_pretrained(model)` (called by every strategy through `optimizer_guard.register_wrapped`) swaps the
class of a HuggingFace model for one whose `save_pretrained` hides ``model.module`` for the duration of the call (so
``unwrap_model`` stops at the model) and, when the model holds pieces of split parameters (or only some layers' trained values) and no
full ``state_dict=`` is given, raises a ValueError with the collective recipe instead of writing them::

    state = sw.full_state_dict(model)                 # every rank (collective)
    if comm.rank == 0:
        model.save_pretrained(out_dir, state_dict=state)
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from torch import nn

from . import layout
from ._mixin import mix_in, original_class
from .files import write_text
from .sharded_tensor import spec_of

__all__ = ["from_transformers", "guard_save_pretrained"]


def from_transformers(module: nn.Module) -> bool:
    """Whether `module`'s class is a transformers class, or a user's subclass of one (strategies' mixins kept)."""
    return any(cls.__module__.startswith("transformers.") for cls in type(module).__mro__)


def _split_pieces(model: nn.Module, state_dict: dict | None) -> list[str]:
    """Names of the tensors about to be saved that are pieces of larger tensors (not whole)."""
    if state_dict is not None:
        named = state_dict.items()
    else:
        named = [*model.named_parameters(), *model.named_buffers()]
    out = []
    for name, tensor in named:
        spec = spec_of(tensor)
        if spec is not None and not spec.whole:
            out.append(name)
    return out


class SavePretrainedGuard:
    """Mixed into a wrapped HuggingFace model: `save_pretrained` saves it, or raises naming the collective recipe
    (module docstring)."""

    @property
    def module(self) -> nn.Module:
        if self.__dict__.get("_sw_saving"):  # transformers' unwrap_model stops at the model
            raise AttributeError("module")
        return super().module  # type: ignore[misc]  # MovesRefused's, or AttributeError

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        save = super().save_pretrained  # type: ignore[misc]
        bound = inspect.signature(save).bind_partial(save_directory, *args, **kwargs).arguments
        given = bound.get("state_dict")
        pieces = _split_pieces(self, given)
        recipe = ("on every rank: state = sw.full_state_dict(model) (collective), then on one rank: "
                  "model.save_pretrained(dir, state_dict=state)")
        if pieces:
            applied = " + ".join(s.name for s in layout.strategies(self)) or "a strategy"
            raise ValueError(f"save_pretrained on a model split over ranks ({applied}) would write this rank's pieces "
                             f"as the whole tensors (e.g. {pieces[0]}); {recipe}")
        if given is None and layout.is_partitioned(self):  # sw.parallelize's pipeline: layers on other ranks
            raise ValueError(f"save_pretrained on a model whose layers are trained on several pipeline ranks (sw."
                             f"parallelize) would write this rank's untrained copies of the other ranks' layers; "
                             f"{recipe}")
        object.__setattr__(self, "_sw_saving", True)
        try:
            result = save(save_directory, *args, **kwargs)
        finally:
            object.__setattr__(self, "_sw_saving", False)
        _name_the_architecture(self, save_directory, bound.get("is_main_process", True))
        return result


def _name_the_architecture(model: nn.Module, directory: Any, main: bool) -> None:
    """transformers writes `config.architectures` as the model's class name, which the strategies' mixins prefix
    ("SavePretrainedShardedLlamaForCausalLM"): a loader that picks the class by it (vLLM, pipelines) would not find
    it. The original class's name replaces it, in the config and in the written config.json."""
    config, name = getattr(model, "config", None), original_class(model).__name__
    if config is None or getattr(config, "architectures", None) in (None, [name]):
        return
    config.architectures = [name]
    path = Path(directory) / "config.json"
    if main and path.is_file():
        written = json.loads(path.read_text())
        written["architectures"] = [name]
        write_text(path, json.dumps(written, indent=2, sort_keys=True) + "\n")  # transformers' own layout


def guard_save_pretrained(model: nn.Module) -> None:
    """Give a HuggingFace model (one with `save_pretrained`, a transformers class in its MRO) the guarded
    `save_pretrained`; other models, and a model guarded already, are left as they are."""
    if isinstance(model, SavePretrainedGuard) or not callable(getattr(model, "save_pretrained", None)):
        return
    if from_transformers(model):
        mix_in(model, SavePretrainedGuard, "SavePretrained")

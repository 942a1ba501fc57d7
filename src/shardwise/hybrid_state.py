"""`HybridModel.state_dict()` and `load_state_dict()` under the names of the model given to `sw.parallelize`.

Why. A script keeps ``model = sw.parallelize(model, mesh)`` as it kept ``model = DDP(model)`` and ends the way it
always did: ``torch.save(model.state_dict(), path)``, an EMA or best-so-far copy through ``state_dict()``,
``model.load_state_dict(torch.load(path))`` to resume or to start from pretrained weights. The hybrid's modules are
its pipeline stages, so torch's own `state_dict` named every entry by its stage path (``pipe.stages.0.1.attn...``),
which no plain model loads (and with ``strict=False`` loads nothing, silently); `named_parameters()` already answers
under the model's names.

What. With one pipeline stage per rank (pp = 1), `state_dict()` is the model's: its names, in its order (a weight tied
to another appears under each of its names, as torch gives it), holding what the stage holds -- whole tensors under
DDP, this rank's pieces under ZeRO / FSDP / tensor parallel, which refuse to be pickled naming `sw.full_state_dict`
(collective: the whole model on every rank) and `sw.save_checkpoint`, as `sw.ZeRO`'s state dict does. Under pp > 1
a rank holds some layers only: `state_dict()` raises naming those two, as the parallelized model's own `state_dict()`
does (parallelized_model.py), since saving one rank's would silently save part of the model.

`load_state_dict(state)` takes the model's names -- a one-process state dict, a saved `sw.full_state_dict`, or this
`state_dict()` -- at any pp: each rank loads the entries of the layers it holds (whole tensors are cut into its
pieces by the wrappers' own load hooks: whole/state_dict.py) and leaves the other stages' to their ranks. ``strict``
is torch's: a missing entry of the model (on every rank, whichever holds it), or a name the model does not have,
raises naming them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from . import layout

__all__ = ["ModelNamedState", "model_state_names"]


def model_state_names(model: nn.Module) -> tuple[str, ...]:
    """The keys of ``model.state_dict()`` in torch's order (each module's parameters, then its persistent buffers),
    without calling it: under tensor parallel or ZeRO it would build pieces."""
    names = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        names += [dot + n for n, p in module._parameters.items() if p is not None]
        names += [dot + n for n, b in module._buffers.items()
                  if b is not None and n not in module._non_persistent_buffers_set]
    return tuple(dict.fromkeys(names))


class ModelNamedState(nn.Module):
    """Mixed into `HybridModel`: its state dict under the model's names (module docstring). `_model_state_names` is set
    by `sw.parallelize` (`model_state_names` of the model it was given)."""

    _model_state_names: tuple[str, ...] = ()

    def _stage_keys(self) -> dict[str, list[str]]:
        """This rank's entries: the model's name -> the stage paths of torch's state dict holding that tensor."""
        names = {}
        for pl in layout.placements(self).values():
            names[id(pl.param)] = pl.names
        for name, b in layout.buffers(self).items():
            names[id(b)] = (name,)
        keys: dict[str, list[str]] = {}
        for path, value in nn.Module.state_dict(self, keep_vars=True).items():
            for name in names.get(id(value), (path,)):  # an entry no strategy declares keeps its path
                keys.setdefault(name, []).append(path)
        return keys

    def _refuse_partial(self, call: str) -> None:
        if getattr(self, "mesh", None) is not None and self.mesh.sizes["pp"] > 1:
            raise ValueError(f"{call} of a model split into pipeline stages (pp={self.mesh.sizes['pp']}): this rank "
                             f"holds some layers only, and saving them would save part of the model; use "
                             f"sw.full_state_dict(model) on every rank (collective: the whole model under its own "
                             f"names, then torch.save on one rank) or sw.save_checkpoint(path, model, optimizer)")

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        if args:
            raise ValueError("HybridModel.state_dict: pass destination, prefix and keep_vars by keyword")
        self._refuse_partial("model.state_dict()")
        values = nn.Module.state_dict(self, keep_vars=keep_vars)
        held = self._stage_keys()
        order = [n for n in self._model_state_names if n in held] + [n for n in held if n not in self._model_state_names]
        out = OrderedDict() if destination is None else destination
        for name in order:
            out[prefix + name] = values[held[name][0]]
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> _IncompatibleKeys:
        held = self._stage_keys()
        known = list(self._model_state_names) + [n for n in held if n not in self._model_state_names]
        # Over the whole model's names, not this rank's layers only: every pipeline rank raises, or none; and before
        # anything is copied, so a refused state dict leaves the model as it was.
        missing, names = [name for name in known if name not in state_dict], set(known)
        unexpected = [name for name in state_dict if name not in names]
        if strict and (missing or unexpected):
            lines = ([f"Missing key(s) in state_dict: {', '.join(map(repr, missing))}."] if missing else []) + \
                    ([f"Unexpected key(s) in state_dict: {', '.join(map(repr, unexpected))}."] if unexpected else [])
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__} (the names of the model "
                               f"given to sw.parallelize):\n\t" + "\n\t".join(lines))
        translated = {path: state_dict[name] for name, paths in held.items() if name in state_dict for path in paths}
        nn.Module.load_state_dict(self, translated, strict=False, assign=assign)
        return _IncompatibleKeys(missing, unexpected)

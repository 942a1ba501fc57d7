"""The model given to `sw.parallelize`, after the call: its tools answer for the HybridModel that trains it, and what
would read its stale copies refuses.

Why. `hybrid = sw.parallelize(model, mesh)` trains `model`'s layers in the HybridModel's pipeline stages: under
pp > 1 each rank trains some layers and keeps untrained copies of the others; under ZeRO, FSDP or tensor parallel the
parameters are pieces. The user still holds `model`, and a script ends the way it always did:
``model.save_pretrained(out)`` (HuggingFace), ``torch.save(model.state_dict(), path)``, ``sw.full_state_dict(model)``,
a last ``model(x)`` or ``model.generate(...)``. Under pp > 1 those silently read the stale copies (save_pretrained
wrote the other stages' layers as they were before training); under ZeRO-3 they failed with errors about views of a
piece.

Mechanism (`hand_over`):
* `layout.hand_over(model, hybrid)`: whole-model tools given `model` (`sw.full_state_dict`, `sw.clip_grad_norm_`,
  checkpoints, the grad scaler, memory statistics) ask the hybrid's layout, as they ask a torch.compile()d model's
  original module: `sw.full_state_dict(model)` is the trained model's, under the model's own names.
* HuggingFace's `save_pretrained` is guarded (hf_save.py): without a full ``state_dict=`` it refuses where this rank
  does not hold the whole trained model, naming the recipe (``state = sw.full_state_dict(model)`` on every rank, then
  ``model.save_pretrained(out, state_dict=state)`` on one).
* Under pp > 1, `model.state_dict()` and `model(...)` (so `generate` too) raise a ValueError naming
  `sw.full_state_dict(model)` and `hybrid.step` / `hybrid.predict`. With pp = 1 the model holds this rank's
  parameters themselves, and these work as before (collectively, under tensor parallel).
* The hybrid of a HuggingFace model gets `save_pretrained` (`SavesPretrained`), for the script that kept only it
  (``model = sw.parallelize(model, mesh)``, as ``model = DDP(model)``): called on every rank, it gathers the full
  state dict and the main process (world rank 0, or ``is_main_process=``, transformers' own argument) writes it
  with the model's `save_pretrained`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from . import layout
from ._mixin import mix_in, original_class
from .hf_save import from_transformers, guard_save_pretrained

__all__ = ["hand_over"]


class GivenToParallelize:
    """Mixed into the model given to `sw.parallelize` (module docstring)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        _refuse_stale(self, "calling the model (forward, generate)",
                      "run it through the HybridModel parallelize returned: hybrid.step(...) to train, "
                      "hybrid.predict(...) for its outputs")
        return super().forward(*args, **kwargs)  # type: ignore[misc]

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        _refuse_stale(self, "model.state_dict()", "sw.full_state_dict(model) (on every rank: collective) gives the "
                                                  "trained model's whole state dict under these names")
        return super().state_dict(*args, **kwargs)  # type: ignore[misc]


def _refuse_stale(model: nn.Module, what: str, instead: str) -> None:
    if layout.is_partitioned(model):  # the hybrid's: its pipeline spans more than one rank
        raise ValueError(f"{what}: {original_class(model).__name__} was given to sw.parallelize, which trains its "
                         f"layers on several pipeline ranks; this rank's copies of the other ranks' layers are not "
                         f"trained, so the result would be stale; {instead}")


class SavesPretrained:
    """Mixed into the HybridModel of a HuggingFace model: its `save_pretrained` (module docstring)."""

    def save_pretrained(self, save_directory: Any, *args: Any, is_main_process: bool | None = None,
                        state_dict: dict | None = None, **kwargs: Any) -> None:
        """Collective: call it on every rank. Writes the trained model as ``model.save_pretrained`` of the model
        given to `sw.parallelize` writes it, from the main process (world rank 0 unless `is_main_process` says)."""
        from .whole.state_dict import full_state_dict

        world = self.mesh.world  # type: ignore[attr-defined]  # HybridModel's mesh
        if state_dict is None:
            state_dict = full_state_dict(self)
        if (world.rank == 0) if is_main_process is None else is_main_process:
            given = self.__dict__["_shardwise_given_model"]
            # A copy: transformers empties the dict it writes, and the caller may still hold it.
            given.save_pretrained(save_directory, *args, state_dict=dict(state_dict), **kwargs)
        world.barrier()  # every rank returns once the files are written


def hand_over(model: nn.Module, hybrid: nn.Module) -> None:
    """Make `model` answer for `hybrid`, the HybridModel that `sw.parallelize` built from it (module docstring)."""
    layout.hand_over(model, hybrid)
    guard_save_pretrained(model)
    mix_in(model, GivenToParallelize, "Parallelized")
    if from_transformers(model) and callable(getattr(model, "save_pretrained", None)):
        hybrid.__dict__["_shardwise_given_model"] = model  # not a submodule: its layers are the stages'
        mix_in(hybrid, SavesPretrained, "SavesPretrained")

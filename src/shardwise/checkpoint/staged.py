"""The record of one rank's checkpoint load between staging and commit (load.py runs the steps).

`Staged` holds what the rank will write at commit (host copies of its tensors, the optimizer's hyperparameters and
state, the declared strategy states' checked dicts, the RNG states), what it found wrong (`problems`) and which
checkpoint tensors it consumed. `match` checks one entry against the model; `commit` writes everything, in memory
only. Staging itself is load.py's (it reads through reader.py), the optimizer's part optim_load.py's and the strategy
states' strategy_state.py's: each of them fills this record, so this module imports none of them.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .. import layout
from ..dropout_stream import restore_positions
from .validate import tensor_dtype

__all__ = ["Staged"]


class Staged:
    """What one rank will write at commit, and what it found wrong (load.py's module docstring, steps 1-2)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model, self.optimizer = model, optimizer
        self.directory: Path | None = None
        self.metadata: dict[str, Any] = {}
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live tensor, staged host copy)
        self.group_values: list[dict[str, Any]] = []
        self.optim_state: list[tuple[torch.Tensor, dict[str, Any]]] = []
        self.rng: tuple[Any, ...] | None = None
        self.problems: dict[str, str] = {}  # checkpoint name (or "optimizer", "param_groups") -> what is wrong
        self.consumed: set[str] = set()
        self.optim_checked = optimizer is not None  # False: optim/* tensors are neither loaded nor unexpected
        self.strategy_loads: list[tuple[layout.ExtraState, dict[str, Any]]] = []  # (declared state, staged dict)

    def match(self, name: str, what: str, shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, Any] | None:
        """The checkpoint's entry for `name` if it has the model's shape and dtype, else None (problem recorded)."""
        entry = self.metadata["tensors"].get(name)
        if entry is None:
            self.problems[name] = f"{what} is not in the checkpoint"
            return None
        self.consumed.add(name)
        if list(entry["shape"]) != list(shape):
            self.problems[name] = (f"{what} has shape {tuple(shape)} in the model but {tuple(entry['shape'])} in "
                                   f"the checkpoint")
        elif tensor_dtype(entry["dtype"], name) != dtype:
            self.problems[name] = (f"{what} is {str(dtype).removeprefix('torch.')} in the model but "
                                   f"{entry['dtype']} in the checkpoint")
        return None if name in self.problems else entry

    def commit(self) -> None:
        """Step 4: copy the staged tensors into place, install the optimizer's groups and state, hand each declared
        strategy state its dict, restore the RNG states (in-memory copies only: nothing here can fail halfway)."""
        with torch.no_grad():
            for live, staged in self.copies:
                live.copy_(staged)
        if self.optimizer is not None:
            for group, values in zip(self.optimizer.param_groups, self.group_values):
                group.update(values)
            for p, state in self.optim_state:
                self.optimizer.state[p] = state
        for state, values in self.strategy_loads:  # checked at staging (strategy_state.py): nothing left to refuse
            state.load_state_dict(values)
        if self.rng is not None:
            python, numpy_state, states, positions = self.rng
            for name, state in states.items():
                if name == "rng/torch":
                    torch.set_rng_state(state)
                elif torch.cuda.is_available() and int(name[len("rng/cuda"):]) < torch.cuda.device_count():
                    torch.cuda.set_rng_state(state, int(name[len("rng/cuda"):]))
            random.setstate(python)
            np.random.set_state(numpy_state)
            restore_positions(self.model, positions)  # the dropout streams' (dropout_stream.py)

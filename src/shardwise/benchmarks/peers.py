"""The implementations `shardwise bench` runs side by side: shardwise's strategies, the peers that do the same job,
and the no-communication floor.

    row         what it runs                                                     peer of
    local       the plain model, no communication: each rank trains its own      (the compute floor)
                replica on its own batch (the per-rank work of sw_ddp: forward,
                backward, AdamW over every parameter, without the all-reduce)
    sw_ddp      shardwise.DDP                                                    torch_ddp
    torch_ddp   torch.nn.parallel.DistributedDataParallel(model)
    sw_zero1    shardwise.ZeRO(stage=1, wrap=Block)                              ds_zero1
    sw_zero2    shardwise.ZeRO(stage=2, wrap=Block)                              ds_zero2
    sw_zero3    shardwise.ZeRO(stage=3, wrap=Block)                              fsdp2, ds_zero3
    fsdp2       torch fully_shard per Block, then the root (PyTorch FSDP2)
    ds_zero1-3  deepspeed.initialize with zero_optimization.stage 1-3, "torch_adam": true (the same
                torch.optim.AdamW) and gradient_clipping 0.0 (DeepSpeed >= 0.19 clips to 1.0 by default,
                the other rows do not); DS_ACCELERATOR=cpu

Every row trains the same GPT (same seed) with AdamW in fp32 on the same batches, one step being forward,
backward, optimizer step and zero_grad (DeepSpeed: engine(x, y), engine.backward(loss), engine.step()), as in
/work's PEERS.md measurements. A peer whose library cannot be imported is not run; `missing()` says why and
`Peer.install` how to get it. torch peers are wrapped by comm/torch_peers.py over the process group of the
Communicator they are given (this file never touches a process group: DESIGN.md rule 1).

Model states (`Runner.held_bytes`): shardwise rows ask `sw.memory_stats` (strategies declare what they hold); the
others count the storages of their parameters (DTensors by their local shard), gradients and optimizer state,
each storage once. DeepSpeed keeps its partitions in private structures, so its rows report peak RSS only.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..comm.base import Communicator
from ..comm.torch_peers import FSDP2_REQUIRES, fully_shard_blocks, import_fsdp2, torch_ddp

__all__ = ["Peer", "PEERS", "ORDER", "missing", "prepare", "build", "Runner"]


@dataclasses.dataclass(frozen=True)
class Peer:
    """One row of the benchmark. name: its key. label: what the table shows. library: who implements it.
    strategy: its key in `formulas` (wire bytes, memory estimate). requires: (module, attribute or None) that must
    import for it to run. install: the command that gets it. peer_of: the shardwise row it is compared with."""

    name: str
    label: str
    library: str
    strategy: str
    requires: tuple[str, str | None] | None = None
    install: str = ""
    peer_of: str | None = None


_DS_INSTALL = "DS_BUILD_OPS=0 pip install deepspeed"
_FSDP2_INSTALL = "pip install 'torch>=2.6' (fully_shard is public from torch 2.6)"

PEERS: dict[str, Peer] = {p.name: p for p in [
    Peer("local", "no communication (floor)", "torch", "none"),
    Peer("sw_ddp", "shardwise DDP", "shardwise", "ddp"),
    Peer("torch_ddp", "PyTorch DDP", "torch", "ddp", ("torch.nn.parallel", "DistributedDataParallel"),
         "pip install torch", peer_of="sw_ddp"),
    Peer("sw_zero1", "shardwise ZeRO-1", "shardwise", "zero1"),
    Peer("ds_zero1", "DeepSpeed ZeRO-1", "deepspeed", "zero1", ("deepspeed", None), _DS_INSTALL, "sw_zero1"),
    Peer("sw_zero2", "shardwise ZeRO-2", "shardwise", "zero2"),
    Peer("ds_zero2", "DeepSpeed ZeRO-2", "deepspeed", "zero2", ("deepspeed", None), _DS_INSTALL, "sw_zero2"),
    Peer("sw_zero3", "shardwise ZeRO-3", "shardwise", "zero3"),
    Peer("fsdp2", "PyTorch FSDP2 (fully_shard)", "torch", "zero3", FSDP2_REQUIRES, _FSDP2_INSTALL, "sw_zero3"),
    Peer("ds_zero3", "DeepSpeed ZeRO-3", "deepspeed", "zero3", ("deepspeed", None), _DS_INSTALL, "sw_zero3"),
]}
#: The rows in table order.
ORDER = tuple(PEERS)


def missing(name: str) -> str | None:
    """Why row `name` cannot run here (its library does not import), or None. Looks a top-level package up without
    importing it (DeepSpeed's import takes seconds), and imports a torch submodule to find the attribute."""
    peer = PEERS[name]
    if peer.requires is None:
        return None
    module, attribute = peer.requires
    if attribute is None:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
        return None
    try:
        found = hasattr(importlib.import_module(module), attribute)
    except ImportError as exc:
        return f"{module} does not import: {exc}"
    return None if found else f"{module}.{attribute} does not exist in torch {torch.__version__}"


class Runner:
    """One model under test on this rank: `step(x, y)` trains one step and returns the loss; with `track_memory`,
    `held_bytes()` is the most model-state bytes (params + grads + optimizer state) this rank held right after an
    optimizer step (before zero_grad frees the gradients), or None where they cannot be read (DeepSpeed)."""

    def __init__(self, name: str, model: torch.nn.Module, opt: Any, engine: Any = None,
                 held: Callable[[], int | None] | None = None) -> None:
        self.name, self.model, self.opt, self.engine = name, model, opt, engine
        self._held = held
        self.track_memory = False  # set by the memory run: read the model states after every optimizer step
        self.peak_held: int | None = None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if self.engine is not None:  # DeepSpeed: the engine owns backward, the optimizer step and zero_grad
            loss = self.engine(x, y)
            self.engine.backward(loss)
            self.engine.step()
        else:
            loss = self.model(x, y)
            loss.backward()
            self.opt.step()
            if self.track_memory and self._held is not None:  # the peak: gradients and optimizer state both held
                self.peak_held = max(self.peak_held or 0, self._held())
            self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def held_bytes(self) -> int | None:
        """The most model-state bytes seen right after an optimizer step (with track_memory), else None."""
        return self.peak_held


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    tensors = [_local(p) for p in model.parameters()]
    tensors += [_local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [_local(v) for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def _quiet_deepspeed() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # DeepSpeed calls torch's renamed collectives
    warnings.filterwarnings("ignore", category=UserWarning)
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def prepare(name: str) -> None:
    """Import what row `name` needs before anything is measured (an import is not the model's cost)."""
    if PEERS[name].library == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                              str(Path.home() / ".cache" / "shardwise-bench-torch-extensions"))
        _quiet_deepspeed()
        importlib.import_module("deepspeed")
    elif name == "fsdp2":
        import_fsdp2()


def build(name: str, comm: Communicator, model: torch.nn.Module, lr: float, batch_size: int) -> Runner:
    """Wrap `model` (built identically on every rank) as row `name` and give it its AdamW (lr, fp32)."""
    from .. import DDP, ZeRO, memory_stats
    from ..models.gpt import Block

    def adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=lr)

    def plain(m: torch.nn.Module) -> Runner:
        opt = adamw(m)
        return Runner(name, m, opt, held=lambda: _storage_bytes(m, opt))

    if name == "local":
        return plain(model)
    if name.startswith("sw_"):
        wrapped = DDP(model, comm) if name == "sw_ddp" else ZeRO(model, comm, stage=int(name[-1]), wrap=Block)
        opt = adamw(wrapped)
        return Runner(name, wrapped, opt, held=lambda: memory_stats(wrapped, opt).model_states)
    if name == "torch_ddp":
        return plain(torch_ddp(model, comm))
    if name == "fsdp2":
        return plain(fully_shard_blocks(model, model.blocks, comm))
    if name.startswith("ds_zero"):
        prepare(name)
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": batch_size, "steps_per_print": 10**9,
                  "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
                  "zero_optimization": {"stage": int(name[-1])}, "gradient_clipping": 0.0}
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        return Runner(name, engine.module, opt, engine=engine)
    raise ValueError(f"bench: unknown row {name!r}; allowed {list(PEERS)}")

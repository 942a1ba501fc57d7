"""Where a forward first differs: every module's output at the first step, compared between the two runs.

When the loss differs at step 0, before any gradient or update, some module computes differently under the strategy
(a layer a plan replaced without its own forward, a statistic over the batch). Both runs record, during their first
forward, the first output of every module (its first call; a tensor, or the first tensor of a tuple, list or
HuggingFace ModelOutput), by module name, in the order the modules finished. `first_difference` walks the
reference's modules in that order and compares each output the two runs can compare: a module of the same name whose
output, on the strategy's rank 0, has the shape of that data-parallel rank's rows of the reference's output (the
batch is split along dim 0). Others (a tensor-parallel shard, an output that is not batch-major) are skipped. The
first module that differs is named, with the number that agreed before it: the place to look.

The recorder also notes which modules drew from torch's generators during that forward (its state changed inside
the module's call and inside none of its submodules' calls): functional dropout (`F.dropout(x, p, self.training)`),
noise (`torch.randn_like`), stochastic depth. One process and the ranks draw other numbers there, so a check of such
a model differs from its first forward whatever the strategy; the report names them. Only the one-process run
watches (`watch_draws`): it runs the same forward as the ranks, alone, where thread ranks share torch's generator
(a rank would see another's draws) and draw their dropout from streams of their own (dropout_stream.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["OutputRecorder", "first_difference"]


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


class OutputRecorder:
    """Forward hooks on every module of `model` that keep a detached copy of each module's first output."""

    def __init__(self, model: nn.Module, watch_draws: bool = False) -> None:
        self.outputs: dict[str, torch.Tensor] = {}
        self.kinds: dict[str, str] = {}
        self.drew: list[str] = []  # modules whose own code drew random numbers, innermost (module docstring)
        self._open: list[tuple[list[torch.Tensor], int]] = []  # per running call: generator states, len(drew)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._generators = [torch.default_generator]
        if device.type == "cuda":
            self._generators.append(torch.cuda.default_generators[device.index or torch.cuda.current_device()])
        self._handles = [module.register_forward_hook(self._hook(name)) for name, module in model.named_modules()]
        if watch_draws:
            self._handles += [module.register_forward_pre_hook(self._enter) for module in model.modules()]

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._open.append(([g.get_state() for g in self._generators], len(self.drew)))

    def _left(self, name: str) -> None:
        if not self._open:
            return
        states, drawn_inside = self._open.pop()
        changed = any(not torch.equal(g.get_state(), state) for g, state in zip(self._generators, states))
        if changed and len(self.drew) == drawn_inside and name not in self.drew:
            self.drew.append(name)

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._left(name)
            tensor = _first_tensor(output)
            if name not in self.outputs and tensor is not None and tensor.is_floating_point():
                self.outputs[name] = tensor.detach().to("cpu", torch.float64, copy=True)
                self.kinds[name] = type(module).__name__

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def first_difference(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], kinds: dict[str, str],
                     got_kinds: dict[str, str], index: int, parts: int, rtol: float, atol: float) -> str | None:
    """A note naming the first module (in the reference's finishing order) whose output on data-parallel rank
    `index` of `parts` differs from its rows of the reference's, with its class in both runs when the strategy
    replaced it; None when every comparable output agrees."""
    agreed = 0
    for name, want in ref.items():
        have = got.get(name)
        if have is None or want.dim() == 0 or want.shape[0] % parts:
            continue
        rows = want.shape[0] // parts
        want = want[index * rows:(index + 1) * rows]
        if have.shape != want.shape:
            continue
        diff = (have - want).abs()
        if bool((diff > atol + rtol * want.abs()).any()):
            kind, replaced = kinds.get(name, "?"), got_kinds.get(name, "?")
            kind = kind if replaced == kind else f"{kind} in one process, {replaced} under the strategy"
            where = f"{name!r} ({kind})" if name else f"the model ({kind})"
            return (f"the first module whose output differs in the first forward is {where}: max |diff| "
                    f"{float(diff.max()):.3g}; the {agreed} module outputs compared before it agree")
        agreed += 1
    return None

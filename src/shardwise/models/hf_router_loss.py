"""A HuggingFace MoE's load-balancing loss under `sw.parallelize`, carried through the pipeline stages.

``MixtralForCausalLM`` (and Qwen2/3-MoE, GPT-OSS: experts.hf_kinds ``global_aux_model``) with
``output_router_logits=True`` adds ``router_aux_loss_coef x aux`` to its loss, where transformers'
``load_balancing_loss_func`` (Switch Transformer's loss, Fedus et al. 2021, arXiv 2101.03961) concatenates every MoE
layer's router logits before its two means::

    aux = E x sum_i f_i x P_i,   f_i = (top-k assignments to expert i) / tokens,   P_i = (router probability of i) / tokens

over all layers' tokens, weighted by the attention mask (padding counts for nothing). The pipeline stages bypass the
model's forward, and a stage holds only some of the layers, so the loss is rebuilt from sums that add up over layers:
each decoder layer's `_CarryRouterStatistics` records its routers' logits (forward hooks that record only while it
runs) and adds their `experts.hf_aux.router_statistics` -- assignments per expert, tokens and probability sums, the
tokens weighted by the padding the stages pass on as ``documents`` -- to a running tensor that travels with the
hidden states from stage to stage (a pipeline message like any activation, so backward carries the probabilities'
gradient back through the stages, and activation checkpointing recomputes it with its layer). The loss adds
``coef x balance_loss_of(sums)`` to the last stage's loss, with the sums added over the ranks splitting the batch
(dp x cp: `balance_loss_of` all-reduces the counts and sums the probabilities' gradients back).

With one stage and one microbatch (pp = 1, ``n_microbatches=1``, `sw.parallelize`'s default for such a model) that is
HuggingFace's loss of the whole global batch. With microbatches (pp > 1 or ``n_microbatches > 1``) each microbatch's
router loss is its own, over global microbatch j (the j-th microbatch of every data-parallel rank), as Megatron-LM
computes its auxiliary loss per microbatch (Shoeybi et al. 2019): the step's loss is HuggingFace's causal-LM loss of
the global batch (hf_parallel.GlobalCausalLMLoss) plus ``coef x`` the mean over microbatches of their router losses,
what one process computes accumulating over those microbatches with the causal-LM loss divided by the global batch's
label count (transformers' ``num_items_in_batch``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..comm.base import Communicator

__all__ = ["carry_router_statistics", "router_loss_coef"]

#: the keyword under which the running sums travel beside a stage's keyword outputs (padded rows' dicts)
STATISTICS = "router_statistics"


def router_loss_coef(model: nn.Module) -> float:
    """``router_aux_loss_coef`` of a model whose forward adds Mixtral's load-balancing loss (Mixtral, Qwen2/3-MoE:
    experts.hf_kinds.global_aux_model) with output_router_logits on and a coefficient > 0, else 0.0."""
    from ..experts.hf_kinds import global_aux_model

    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False) or not global_aux_model(model):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def _routers(model: nn.Module) -> tuple[list[nn.Module], int]:
    """The modules whose outputs HuggingFace records as ``router_logits`` (the model's ``_can_record_outputs``:
    MixtralTopKRouter, Qwen3MoeTopKRouter, ...) and the index of the logits in their output."""
    recorder = getattr(type(model), "_can_record_outputs", None) or {}
    recorder = recorder.get("router_logits")
    target = getattr(recorder, "target_class", None)
    if target is None:
        raise ValueError(f"parallelize: {type(model).__name__} does not say which modules' outputs are its router "
                         f"logits (_can_record_outputs['router_logits']); router_aux_loss_coef=0 trains without the "
                         f"load-balancing loss")
    return [m for m in model.modules() if isinstance(m, target)], int(getattr(recorder, "index", 0) or 0)


class _RouterLogits:
    """Forward hooks on a model's routers that append their logits to the list of the layer running them (`record`);
    outside a layer's call they record nothing, so a forward of the model itself keeps nothing."""

    def __init__(self, routers: list[nn.Module], index: int) -> None:
        self.index = index
        self._recording: list[torch.Tensor] | None = None
        for router in routers:
            router.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._recording is not None:
            self._recording.append(output[self.index] if isinstance(output, tuple) else output)

    @contextlib.contextmanager
    def record(self) -> Iterator[list[torch.Tensor]]:
        logits: list[torch.Tensor] = []
        before, self._recording = self._recording, logits
        try:
            yield logits
        finally:
            self._recording = before


def _token_weights(documents: Any, length: int, cp: Communicator | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Padded rows' weights of the `length` tokens of each row the routers saw (B, length): 1 a token, 0 padding
    (hf_stage_inputs.padding_of gives each padding token a document id < 0), None without padding; under context
    parallel the whole sequence's documents are taken at the global positions of this rank's chunks. The routers see
    this rank's whole (context-parallel) sequence also under sequence parallel, where a mixture-of-experts block runs
    on the whole sequence (tensor_parallel/hf_sequence.py) while the layers pass shards on."""
    if documents is None:
        return None
    ranks = cp.size if cp is not None else 1
    if length * ranks != documents.shape[1]:
        raise ValueError(f"parallelize: the routers saw {length} tokens per row, which is not the sequence's "
                         f"{documents.shape[1]} tokens over {ranks} context-parallel rank(s); the load-balancing "
                         f"loss cannot weigh them by the padding")
    if ranks > 1:
        from ..context_parallel.split import SequenceSplit

        split = SequenceSplit(cp.size, True)  # parallelize's: zigzag chunks (hf_stages' default)
        documents = documents[:, split.positions(cp.rank, length, documents.device)]
    from ..context_parallel.documents import token_mask

    return token_mask(documents, dtype)


class _CarryRouterStatistics(nn.Module):
    """One pipeline layer passing the running router statistics on (module docstring): the first layer starts them
    at zero, every other takes them as its last positional argument or as the keyword `STATISTICS`; a layer holding
    routers adds the statistics of the logits they give in its forward."""

    def __init__(self, layer: nn.Module, logits: _RouterLogits | None, start: bool, experts: int, top_k: int,
                 cp: Communicator | None) -> None:
        super().__init__()
        self.layer = layer
        self.start = start
        self.experts, self.top_k = experts, top_k
        self._logits = logits  # None: no router runs in this layer
        self._cp = cp

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.start:
            total = None
        elif STATISTICS in kwargs:
            total = kwargs.pop(STATISTICS)
        else:
            *args, total = args
        recording = self._logits.record() if self._logits is not None else contextlib.nullcontext([])
        with recording as logits:
            out = self.layer(*args, **kwargs)
        if total is None:
            first = out["hidden"] if isinstance(out, dict) else out[0] if isinstance(out, tuple) else out
            # Shape (1, .), not (.): `predict` concatenates the last stage's outputs over microbatches along dim 0.
            total = first.new_zeros(1, 2 * self.experts + 1, dtype=torch.promote_types(first.dtype, torch.float32))
        if logits:
            from ..experts.hf_aux import router_statistics

            hidden = args[0] if args else kwargs["hidden"]
            tokens = logits[0].shape[0]  # B x T: T this rank's whole sequence, or shard (hf_sequence: whole)
            if any(t.dim() != 2 or t.shape[0] != tokens for t in logits) or tokens % hidden.shape[0]:
                raise ValueError(f"parallelize: the routers of {type(self.layer).__name__} gave logits of shapes "
                                 f"{[tuple(t.shape) for t in logits]}; the load-balancing loss needs (tokens, experts) "
                                 f"with tokens = B x T for the layer's B = {hidden.shape[0]}, in row-major order")
            weights = _token_weights(kwargs.get("documents"), tokens // hidden.shape[0], self._cp, hidden.dtype)
            total = total + router_statistics(tuple(logits), self.experts, self.top_k, weights).unsqueeze(0)
        if isinstance(out, dict):
            return {**out, STATISTICS: total}
        return (*out, total) if isinstance(out, tuple) else (out, total)


def carry_router_statistics(model: nn.Module, layers: Sequence[nn.Module], loss_fn: Callable[[Any, Any], Any],
                            batch_group: Communicator, cp: Communicator | None
                            ) -> tuple[list[nn.Module], Callable[[Any, Any], torch.Tensor]]:
    """The pipeline layers of `model` (hf_stages) passing the router statistics on, and `loss_fn` of the last layer's
    output plus ``router_aux_loss_coef x`` the load-balancing loss of the statistics summed over `batch_group` (the
    ranks splitting the batch: dp x cp). cp: the context-parallel group the stages split sequences over (or None)."""
    config = model.config
    coef, experts, top_k = router_loss_coef(model), model.num_experts, model.num_experts_per_tok
    routers, index = _routers(model)
    run = {id(m) for layer in list(model.model.layers)[: config.num_hidden_layers] for m in layer.modules()}
    routers = [r for r in routers if id(r) in run]  # the MoE layers HuggingFace's forward runs (dense: none)
    if not routers:
        raise ValueError(f"parallelize: found no router module in {type(model).__name__}'s decoder layers; "
                         f"router_aux_loss_coef=0 trains without the load-balancing loss")
    record = _RouterLogits(routers, index)
    ids = {id(r) for r in routers}
    carried = [_CarryRouterStatistics(layer, record if any(id(m) in ids for m in layer.modules()) else None,
                                      i == 0, experts, top_k, cp) for i, layer in enumerate(layers)]

    def loss(output: tuple, target: Any) -> torch.Tensor:
        from ..experts.hf_aux import balance_loss_of

        *values, total = output
        value = loss_fn(values[0] if len(values) == 1 else tuple(values), target)
        return value + coef * balance_loss_of(total.reshape(-1), experts, batch_group).to(value.device)

    if hasattr(loss_fn, "begin_step"):
        loss.begin_step = loss_fn.begin_step  # type: ignore[attr-defined]
    return carried, loss


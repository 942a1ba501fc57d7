"""`parallelize(model, mesh, ...)`: data x tensor x pipeline parallelism in one call, composed in one documented order.

Order (torchtitan's, on one validated Mesh):
1. **Tensor parallel** splits the model's layers over `mesh.tp` (in place: module swaps, so the model keeps its
   names), with sequence parallel if asked.
2. **Pipeline split**: the (tensor-parallel) model's `pipeline_layers()` are cut into `pp x virtual_stages` stages
   (balanced by parameters) and `pp.Pipeline` keeps this rank's. Weights tied across stages on different ranks
   (a GPT's embedding and head) have their gradients summed over the ranks holding them.
   (Splitting before tensor parallel, as torchtitan words it, gives the same stages: tensor parallel replaces
   modules inside the layers, and doing it on the whole model first lets a plan use the model's own names.)
3. **Activation checkpointing** of every layer between the first and the last (the shared implementation).
4. **Data parallel** over each local stage and `mesh.dp`: DDP, ZeRO-1/2/3 or FSDP hybrid_shard (dp split into
   replicate x shard groups of `dp_shard`). With pp > 1 the pipeline runs every microbatch under the strategy's
   `no_sync()`, and the reduction runs once per step after the last microbatch (`sync_gradients()`): DDP's
   all-reduce, ZeRO's reduce-scatter. With pp = 1 (dp, dp x tp) the last microbatch runs outside `no_sync()`, so its
   backward launches the reduction as gradients become ready and overlaps it. ZeRO-3 re-gathers each unit as the schedule needs it, for every microbatch's forward and backward.
   ZeRO-2/3 therefore hold the stage's full (unsharded) gradient during the step, as ZeRO-1 does: the price of one
   reduction per step instead of one per microbatch; parameters and optimizer state stay sharded.
   Weights tied across stages stay whole and replicated under ZeRO (`replicated_params`), so their two copies can
   be summed before the average.

Every rank of a dp group feeds its own slice of the global batch (`step(inputs, targets)` takes this rank's
slice: dp index d gets rows [d*b, (d+1)*b) of a global batch of dp*b); tp ranks feed the same slice. The result
trains with any torch.optim optimizer over `parameters()` (this rank's pieces), and declares its layout
(shardwise.layout): clipping, full state dicts, checkpoints, memory statistics and the grad scaler see the whole
model with its original names.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from . import context_parallel, experts, layout
from . import pipeline as pp
from . import tensor_parallel as tp
from .activation_checkpointing import check_interval, checkpoint_every
from .balance_loss import balance_layers, carry_balance_loss, with_balance_loss, without_balance_sum
from .comm.base import ReduceOp
from .hybrid_copies import average_copies_gradients
from .hybrid_data_parallel import data_group, wrap_data_parallel
from .hybrid_plan import DP_STRATEGIES, Plan, check_plan
from .hybrid_state import ModelNamedState, model_state_names
from .mesh import Mesh
from .parallelized_model import hand_over
from .models import hf_parallel
from .placement import to_comm_device
from .sharding import MixedPrecision
from .sharding.offload import offload_level
from .skipped_forward import refuse_skipped_forward
from .tensor_parallel.mappings import gather_from_region
from .tensor_parallel.replica_grads import stages_check

__all__ = ["parallelize", "HybridModel", "DP_STRATEGIES"]


def _layers_and_loss(model: nn.Module, loss_fn: Callable | None, mesh: Mesh,
                     sequence_parallel: bool) -> tuple[list[nn.Module], Callable, bool, bool]:
    """The model's pipeline layers, the loss over the last stage's output, whether that output is a vocabulary slice
    (a tensor-parallel GPT's head) that predict() must gather, and whether `step` cuts the targets over cp like the
    inputs (HuggingFace's loss takes whole labels: models/hf_parallel.py)."""
    from .models.gpt import lm_loss

    if hasattr(model, "pipeline_loss") and (loss_fn is None or loss_fn is lm_loss):
        return model.pipeline_layers(), model.pipeline_loss(), True, True  # vocabulary-parallel loss, local logits
    if hasattr(model, "pipeline_loss"):
        return model.pipeline_layers(gather_logits=True), loss_fn, False, True
    if hasattr(model, "pipeline_layers"):
        return model.pipeline_layers(), loss_fn or lm_loss, False, True
    if hf_parallel.pipeline_builder(model):  # stages, HF's loss (whole labels under cp), Mixtral's router loss
        layers, loss, split_targets = hf_parallel.hf_pipeline(
            model, loss_fn, dp=mesh.dp, cp=mesh.cp, batch_group=data_group(mesh),
            sequence_split=mesh.sizes["tp"] if sequence_parallel else 1)
        return layers, loss, False, split_targets
    raise ValueError(f"parallelize: {type(model).__name__} has no pipeline_layers() and is not a known HuggingFace "
                     f"decoder ({sorted(hf_parallel.BUILDERS)}, or one whose forwards are theirs); give the model a "
                     f"pipeline_layers() method returning its layers")


def _layers_class(model: nn.Module) -> type | None:
    """The class whose forward the pipeline layers reproduce: the one defining pipeline_layers(), or the
    HuggingFace class of a known decoder."""
    if hasattr(model, "pipeline_layers"):
        return next(c for c in type(model).__mro__ if "pipeline_layers" in c.__dict__)
    if hf_parallel.pipeline_builder(model):
        return next((c for c in type(model).__mro__ if c.__module__.startswith("transformers.")), None)
    return None


class HybridModel(ModelNamedState):
    """What `parallelize` returns: this rank's pipeline stages, tensor- and data-parallel (see the module docstring).

    `step(inputs, targets) -> loss` runs one training step (forward and backward of every microbatch, the
    data-parallel reduction) and returns the mean loss of this dp group's batch; `parameters()` are what this rank
    trains; `predict(inputs, to="all")` runs inference; `describe()` says which rank holds which layers and slices;
    `state_dict()` / `load_state_dict()` take the model's own names (hybrid_state.py).
    """

    def __init__(self, pipe: pp.Pipeline, mesh: Mesh, plan: Plan, gather_vocab: bool, names: list[str],
                 split_targets: bool = True, begin_step: Callable[..., None] | None = None,
                 balance_carried: bool = False) -> None:
        super().__init__()
        self._split_targets = split_targets  # False: the loss takes whole sequences (HF's labels under cp)
        self.pipe = pipe
        self.mesh = mesh
        self.plan = plan
        self._gather_vocab = gather_vocab
        self._stage_layers = names
        self._loss_scale = 1.0
        self._begin_step = begin_step  # the loss's, if it counts the step's global batch first
        self._balance_carried = balance_carried  # stages pass a MoE balance-loss sum or router statistics on

    @property
    def balance_loss_per_microbatch(self) -> bool:
        """Whether a MoE balance loss is computed per microbatch (pp > 1 or n_microbatches > 1; balance_loss.py,
        models/hf_router_loss.py)."""
        return self._balance_carried and (self.mesh.sizes["pp"] > 1 or self.pipe.n_microbatches > 1)

    def scaled_loss(self, loss_fn: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
        """`loss_fn` times the current step's loss scale (what the pipeline backpropagates)."""
        def scaled(output: Any, target: Any) -> torch.Tensor:
            loss = loss_fn(output, target)
            # At least fp32 (a float64 loss keeps its digits): a float16 loss times 2**16 would overflow at once.
            scale = self._loss_scale
            return loss.to(torch.promote_types(loss.dtype, torch.float32)) * scale if scale != 1.0 else loss

        return scaled

    def step(self, inputs: Any = None, targets: Any = None, *, loss_scale: float = 1.0) -> torch.Tensor:
        """One training step on this rank's slice of the global batch; returns the loss (every rank).

        inputs: what the first layer takes (a tensor, or a tuple / dict of tensors; a HuggingFace decoder takes
        ``{"input_ids": ..., "position_ids": ...}`` for packed rows, models/hf_stages.py), rows on dim 0.

        loss_scale: multiply every microbatch's loss by this before backward (fp16: `scaler.get_scale()` of a
        `sw.ShardedGradScaler(model)`, then `scaler.step(opt)`; 1/k to accumulate k steps; the loss returned is not).
        """
        stages = list(self.pipe.stages.values())
        inputs, targets = self._begin(inputs, targets, loss_scale)
        if self._overlaps_last_microbatch():
            # One stage per rank and no pipeline: gradient accumulation. Every microbatch but the last runs under
            # no_sync(); the last one's backward launches the reduction unit by unit (bucket by bucket for DDP) as
            # its gradients become ready, overlapping it with that backward, as torch.distributed.pipelining and
            # Megatron's overlap_grad_reduce do.
            (stage,) = stages
            last = self.pipe.n_microbatches - 1

            def around(action: pp.Action) -> contextlib.AbstractContextManager:
                return contextlib.nullcontext() if action.microbatch == last else stage.no_sync()

            loss = self.pipe.step(inputs, targets, around_action=around) / self._loss_scale
        else:
            # Pipeline ranks: every reduction after the schedule, never a data-parallel wait between its sends and
            # receives (a rank blocked on a dp peer that waits on its own pipeline could deadlock).
            with contextlib.ExitStack() as stack:
                for stage in stages:
                    stack.enter_context(stage.no_sync())
                loss = self.pipe.step(inputs, targets) / self._loss_scale
            for stage in stages:  # once per step, after the last microbatch: the same order on every dp rank
                stage.sync_gradients()
        if self.plan.compression is not None:
            average_copies_gradients(self.pipe, self.mesh.tp)
        self.pipe.grads_answer_for_stages()  # after the reduction: torch's clip and GradScaler refuse a stage's part
        return self._sequences_mean(loss)

    def _begin(self, inputs: Any, targets: Any, loss_scale: float) -> tuple[Any, Any]:
        """What `step` and `evaluate` do first: set the loss scale, let a loss over the batch's labels count them
        (HF's, over the global batch), and cut the sequences over cp (the targets too unless the loss takes them
        whole). Returns (inputs, targets) as the pipeline takes them."""
        self._loss_scale = float(loss_scale)
        if self._begin_step is not None and targets is not None:  # a loss over the step's global batch counts first
            self._begin_step(targets, self.pipe.n_microbatches, inputs)
        return self._split_sequence(inputs), self._split_sequence(targets) if self._split_targets else targets

    def _sequences_mean(self, loss: torch.Tensor) -> torch.Tensor:
        """Each cp rank's loss is its chunk's mean: the sequence's is their mean."""
        if self.mesh.sizes["cp"] > 1:
            loss = loss.detach().clone()
            self.mesh.cp.all_reduce(loss, ReduceOp.AVG)
        return loss

    def _split_sequence(self, batch: Any) -> Any:
        """Under context parallel, this rank's chunks of every sequence of `batch` (context_parallel.split_sequence;
        None, on a pipeline rank that needs no input, stays None)."""
        if self.mesh.sizes["cp"] == 1 or batch is None:
            return batch
        return context_parallel.split_sequence(batch, self.mesh.cp)

    def _overlaps_last_microbatch(self) -> bool:
        """Whether the step reduces during the last microbatch's backward: pp = 1 (one stage on this rank, no sends
        or receives), a schedule of whole backward passes (a split backward's weight pass comes later), and a
        data-parallel group to reduce over."""
        return (self.mesh.sizes["pp"] == 1 and len(self.pipe.stages) == 1 and data_group(self.mesh).size > 1
                and all(a.op in (pp.Op.FORWARD, pp.Op.BACKWARD) for a in self.pipe.actions))

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their names in the model given to `parallelize` (``blocks.0.attn.qkv.weight``,
        not the stage path ``pipe.stages.0.1.attn.qkv.weight``), in the same order: as torch.distributed.pipelining's
        stages and torchtitan keep them, so a script that freezes, groups or logs parameters by name does what it does
        on the plain model. A weight tied across pipeline stages has its one-process name on each rank holding it."""
        if recurse:  # the model itself holds none: its stages do
            for name, placement in layout.placements(self).items():
                yield (f"{prefix}.{name}" if prefix else name), placement.param

    def forward(self, inputs: Any = None, targets: Any = None) -> torch.Tensor:
        """`step`; under ``torch.no_grad()`` -- ``model.eval(); with torch.no_grad(): loss = model(x, y)``, a
        validation loop -- `evaluate`, which trains nothing."""
        if torch.is_grad_enabled():
            return self.step(inputs, targets)
        if targets is None:  # every rank raises alike, before any pipeline rank waits on another
            raise ValueError("model(inputs) under torch.no_grad(): the model sw.parallelize returns computes the "
                             "loss of (inputs, targets) (model.evaluate); for its output (the logits) call "
                             "model.predict(inputs)")
        return self.evaluate(inputs, targets)

    @torch.no_grad()
    def evaluate(self, inputs: Any = None, targets: Any = None) -> torch.Tensor:
        """The loss `step` returns for this batch (this dp group's, on every rank), computed with the forward-only
        schedule under no_grad: no graph, no gradient touched, no data-parallel reduction. Call `eval()` first to
        disable dropout. Collective over every rank, as `step`."""
        return self._sequences_mean(self.pipe.evaluate(*self._begin(inputs, targets, 1.0)))

    @torch.no_grad()
    def predict(self, inputs: Any = None, *, to: str | int = "all") -> Any:
        """The model's output (logits) for `inputs`, under no_grad with the forward-only schedule; on every rank
        (to="all") or on pipeline rank `to` only. Call `eval()` first to disable dropout."""
        out = self.pipe.predict(self._split_sequence(inputs), to=to)
        out = without_balance_sum(out) if self._balance_carried else out
        if out is not None and self._gather_vocab:
            out = gather_from_region(out, self.mesh.tp, -1)
        if out is not None and self.mesh.sizes["cp"] > 1:  # every rank of a cp group holds (or lacks) its chunks
            out = context_parallel.gather_sequence(out, self.mesh.cp)
        return out

    def describe(self) -> str:
        """The mesh, then for each pipeline rank the layers it holds; tensor-parallel ranks hold 1/tp of each."""
        sizes = self.mesh.sizes
        over = "dp" if sizes["cp"] == 1 else "dp x cp"
        extra = (f", context parallel ({self.plan.cp_method}) over cp" if sizes["cp"] > 1 else "") + (
            f", experts split over ep={sizes['ep']} (averaged over edp={sizes['edp']})" if sizes["ep"] > 1 else "")
        lines = [self.mesh.describe(), f"Strategy: {self.plan.dp_strategy} over {over}{extra}, tp plan "
                 f"{self.plan.tp_plan!r}"
                 f"{' + sequence parallel' if self.plan.sequence_parallel else ''}, schedule {self.plan.pp_schedule} "
                 f"with {self.plan.n_microbatches} microbatches"]
        lines += [f"  stage {s} (pp rank {s % self.mesh.sizes['pp']}): {text}" for s, text in
                  enumerate(self._stage_layers)]
        return "\n".join(lines)


def _stage_names(model: nn.Module, stages: list[nn.Module]) -> list[str]:
    """Per stage, the original names of the modules holding its parameters, blocks collapsed (for describe())."""
    original = {id(m): n for n, m in model.named_modules()}
    out = []
    for stage in stages:
        names = []
        for module in stage.modules():
            name = original.get(id(module))
            if name and any(True for _ in module.parameters(recurse=False)):
                parts = name.split(".")
                names.append(".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else name)
        out.append(", ".join(dict.fromkeys(names)) or "(no parameters)")
    return out


def _declare(hybrid: HybridModel, model: nn.Module, mesh: Mesh) -> None:
    """The hybrid's record: the union of its stages' placements (original names), every group, the world."""
    # The pipeline's own record already unions its stages (placements, groups, memory) as they are wrapped now;
    # the hybrid adds what the pipeline cannot know: the whole mesh's world and the model's buffer names.
    pipeline = layout.strategies(hybrid.pipe)[-1]
    original = {id(b): n for n, b in model.named_buffers()}
    buffer_names = {n: original[id(b)] for n, b in hybrid.named_buffers() if id(b) in original}
    layout.declare(hybrid, dataclasses.replace(
        pipeline, name="hybrid", world=mesh.world, buffer_names=buffer_names,
        options={"dp_strategy": hybrid.plan.dp_strategy, "schedule": hybrid.plan.pp_schedule, **mesh.sizes}))


def parallelize(
    model: nn.Module,
    mesh: Mesh,
    *,
    tp_plan: str | dict[str, object] | None = None,
    sequence_parallel: bool = False,
    pp_schedule: str = "1f1b",
    n_microbatches: int | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    dp_strategy: str = "ddp",
    dp_shard: int | None = None,
    virtual_stages: int = 1,
    activation_checkpointing: bool | int = False,
    mixed_precision: MixedPrecision | None = None,
    cpu_offload: bool | str = False,
    compression: Any = None,
    find_unused_parameters: bool = False,
    cp_method: str = "ring",
    buffer_writes: str | None = None,
) -> HybridModel:
    """Data x tensor x pipeline parallelism over `mesh`, in the documented order (see the module docstring).

    model: the plain model, identical on every rank (same seed or state dict).
    mesh: `Mesh(comm, dp=None, tp, pp)` (dp=None: the remaining ranks).
    tp_plan: a tensor-parallel plan ("gpt", "llama", "gpt2", "hf" or a dict); needed when tp > 1.
    sequence_parallel: shard the LayerNorm / dropout regions along the sequence too (Korthikanti et al. 2022).
    pp_schedule: "gpipe", "1f1b", "interleaved_1f1b" (with virtual_stages > 1) or "zb_h1" (DDP only).
    n_microbatches: microbatches per step (default 2 x pp, at least 1; 1 with pp = 1 for a model whose MoE layers have
        a load-balancing loss); this rank's batch must split evenly.
    loss_fn: loss_fn(output, target) of one microbatch; default: the model's own (the GPT's next-token loss,
        vocabulary-parallel under tensor parallel; HuggingFace's causal-LM loss of `step(input_ids, labels)`, which
        under cp > 1 takes the whole labels: models/hf_parallel.py). Under cp > 1 a loss_fn of your own gets this
        rank's chunks of the output and of the targets, cut alike.
    dp_strategy: "ddp", "zero1", "zero2", "zero3", "fsdp:full_shard", "fsdp:shard_grad_op" or "fsdp:hybrid_shard"
        (with dp_shard: the size of the shard groups within dp).
    activation_checkpointing: recompute layers between the first and the last in backward: True for every one, an
        int k for every k-th.
    mixed_precision: compute dtypes (`sw.MixedPrecision(param_dtype=torch.bfloat16)`) for a sharded dp_strategy;
        fp32 master shards are kept. With float16 use `sw.ShardedGradScaler(model)`.
    cpu_offload: for a sharded dp_strategy, the engine's offload level ("optimizer", "full" = True, False; see
        `sw.ZeRO`): each stage's master shards, gradients and optimizer state live on the host.
    compression: a `sw.compression` method for the dp axis's gradient reduction (each stage keeps its own state):
        with ddp, zero1/2, fsdp:hybrid_shard (its replicate axis); refused with zero3 and the other fsdp strategies
        (docs/compression.md has the table). Each stage's compressor state is declared as `stages.<s>.compressor`
        and saved by `sw.save_checkpoint`; copies of tied and tp-replicated parameters are averaged after the
        compressed reduction so they stay equal.
    find_unused_parameters: with dp_strategy="ddp", let parameters get no gradient in some steps (DDP's option: a
        parameter no rank used keeps grad None); the sharded strategies do that without being asked.
    cp_method: with cp > 1, "ring" (ring attention, zigzag) or "ulysses" (all-to-all over heads: n_heads / tp
        divisible by cp); every rank of a cp group is given its dp rank's batch and `step` splits the sequence; with
        tp > 1 context parallel runs on each tp rank's heads (docs/context_parallel.md).
    buffer_writes: the data-parallel wrappers' option (None: a buffer a training forward leaves different across
        the dp (x cp) ranks raises; "local": each rank keeps its own; docs/forward_writes.md).
    With ep > 1 the model's MoE layers have their experts split over mesh.ep (shardwise.experts; docs/experts.md).
    A MoE layer's load-balancing loss (moe_aux_loss_coef > 0) is added to the loss: over the global batch as
    `GPT.forward` computes it with pp = 1 and one microbatch, else per microbatch (as one process accumulating
    over the microbatches; balance_loss.py), and so is a HuggingFace MoE's router loss (output_router_logits,
    router_aux_loss_coef > 0; models/hf_router_loss.py).
    Raises ValueError at wrap time for any combination it does not support, naming the argument.
    """
    if not isinstance(mesh, Mesh):
        raise ValueError(f"parallelize: mesh must be a shardwise.Mesh, got {type(mesh).__name__}")
    if n_microbatches is None:  # one with a MoE balance loss at pp = 1: it is a function of the whole batch
        balanced = isinstance(model, nn.Module) and (balance_layers(model) or hf_parallel.router_loss_coef(model) > 0)
        n_microbatches = 1 if mesh.sizes["pp"] == 1 and balanced else 2 * mesh.sizes["pp"]
    plan = Plan(tp_plan, bool(sequence_parallel), pp_schedule, n_microbatches, virtual_stages, dp_strategy, dp_shard,
                 check_interval(activation_checkpointing, "parallelize"), mixed_precision,
                 offload_level(cpu_offload), compression, find_unused_parameters, cp_method, buffer_writes)
    check_plan(mesh, plan, model)
    refuse_skipped_forward(model, _layers_class(model))
    to_comm_device(model, mesh.world, "parallelize")  # every axis of the mesh shares the world's device
    if mesh.sizes["tp"] > 1:
        tp.parallelize(model, mesh.tp, tp_plan, sequence_parallel=sequence_parallel)
    if mesh.sizes["cp"] > 1:  # torchtitan's order: tp, then cp, ep, pp, AC, dp
        context_parallel.apply(model, mesh.cp, method=cp_method)
    if mesh.sizes["ep"] > 1:
        experts.expert_parallel(model, mesh)
    layers, loss, gather_vocab, split_targets = _layers_and_loss(model, loss_fn, mesh, plan.sequence_parallel)
    balanced = balance_layers(model)  # after expert parallel, which may replace the MoE layers
    per_microbatch = mesh.sizes["pp"] > 1 or plan.n_microbatches > 1
    if balanced and per_microbatch:  # passed from stage to stage (balance_loss.py)
        layers, loss = carry_balance_loss(layers, loss)
    else:
        loss = with_balance_loss(loss, balanced)
    # HF router statistics: hf_pipeline's layers carry them, always (models/hf_router_loss.py)
    carried = bool(balanced) and per_microbatch or hf_parallel.router_loss_coef(model) > 0
    stages = pp.partition(layers, mesh.sizes["pp"], virtual_stages=virtual_stages, balance="params")
    pipe = pp.Pipeline(stages, mesh.pp, schedule=pp_schedule, n_microbatches=plan.n_microbatches, loss_fn=loss,
                       buffer_writes=plan.buffer_writes)
    if mixed_precision is not None and pipe.tied:
        raise ValueError(f"parallelize: mixed_precision with weights tied across pipeline ranks "
                         f"({'; '.join(pipe.tied.names)}) is not supported: the tied copies stay whole fp32 "
                         f"parameters outside the engine's compute casts; untie them (e.g. GPTConfig(tie_weights="
                         f"False)) or use pp=1")
    checkpoint_every(layers[1:-1], plan.activation_checkpointing)
    model_placements = {id(pl.param): pl for pl in layout.placements(model).values()}
    tp_check = stages_check(pipe.stages.values(), mesh.tp)  # the replicated gradients agree (replica_grads.py)
    for stage in pipe.stages.values():
        # The stage's parameters under their original names (and tensor-parallel boxes), with the ties the
        # pipeline declared (a tied weight stays whole under ZeRO), before data parallel.
        tied = {id(pl.param): pl.tied_over for pl in layout.placements(stage).values()}
        own = {}
        for p in stage.parameters():
            pl = dataclasses.replace(model_placements[id(p)], tied_over=tied[id(p)])
            own[pl.name] = pl
        layout.declare(stage, layout.Parallelized("stage", (mesh.tp,) if mesh.sizes["tp"] > 1 else (), own,
                                                  before_step=tp_check))
        wrap_data_parallel(stage, mesh, plan)
    hybrid = HybridModel(pipe, mesh, plan, gather_vocab, _stage_names(model, stages), split_targets,
                         getattr(loss, "begin_step", None), carried)
    pipe.loss_fn = hybrid.scaled_loss(loss)
    hybrid._model_state_names = model_state_names(model)  # its state_dict's names (hybrid_state.py)
    _declare(hybrid, model, mesh)
    hand_over(model, hybrid)  # the tools given `model` answer for the hybrid; stale reads refuse
    return hybrid

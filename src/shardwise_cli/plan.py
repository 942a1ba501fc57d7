"""`shardwise plan`: memory per GPU and bytes per step of every strategy, and the planner's recommendation."""

from __future__ import annotations

import argparse
import functools

from .common import fail, positive_float, positive_int

#: What `shardwise plan` offers, torch-free (tests/test_cli_plan.py checks them against shardwise.planner.costs).
PLAN_OPTIMIZERS = ("adam", "adamw", "none", "sgd", "sgd_momentum")
PLAN_DTYPES = ("bf16", "fp16", "fp32")
PLAN_ATTENTION = ("eager", "fused")
_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _param_count(text: str) -> float:
    """A parameter count: 7e9, 7000000000, 7B, 350M, 1.5T."""
    scale = _SUFFIXES.get(text[-1:].lower(), 1.0)
    number = text[:-1] if scale != 1.0 else text
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count (write 7e9, 7B or 350M)") from None
    if not value >= 1 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be at least one parameter")
    return value


def _factory(text: str) -> str:
    module, sep, name = text.partition(":")
    if not sep or not module or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not module:factory (e.g. mypkg.models:build)")
    return text


def add_plan(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="memory per GPU and bytes per step of every strategy for a model size and GPU count; the recommendation",
        description="Estimate, without running anything, the memory per GPU (ZeRO model states; activations with "
        "--seq and --batch, after Korthikanti et al. 2022) and the bytes on the wire per step of every strategy "
        "that applies to --gpus GPUs, and recommend the fastest that fits in --gpu-mem (the planner of "
        "sw.distribute; docs/planning.md states its assumptions).",
    )
    p.add_argument("--params", type=_param_count, default=None,
                   help="parameter count: 7e9, 7B, 350M (or give --model)")
    p.add_argument("--model", type=_factory, default=None,
                   help="module:factory returning the torch.nn.Module to plan for (its parameters and config)")
    p.add_argument("--gpus", type=positive_int, default=1, help="number of GPUs (ranks) (default: %(default)s)")
    p.add_argument("--gpus-per-node", type=positive_int, default=None,
                   help="GPUs per node (default: min(--gpus, 8))")
    p.add_argument("--gpu-mem", type=positive_float, default=80.0,
                   help="memory per GPU in GB of 10^9 bytes (default: %(default)s)")
    p.add_argument("--optimizer", choices=PLAN_OPTIMIZERS, default="adamw",
                   help="sizes the optimizer state; 'none' counts weights and gradients only (default: %(default)s)")
    p.add_argument("--dtype", choices=PLAN_DTYPES, default="bf16",
                   help="training dtype; bf16/fp16 mean mixed precision with fp32 master weights (default: "
                   "%(default)s)")
    p.add_argument("--seq", type=positive_int, default=None, help="sequence length (with --batch: activations)")
    p.add_argument("--batch", type=positive_int, default=None, help="sequences per GPU per step")
    p.add_argument("--hidden", type=positive_int, default=None, help="hidden size (default: the model's, or "
                   "derived from --params assuming h = 128 x layers)")
    p.add_argument("--layers", type=positive_int, default=None, help="transformer layers")
    p.add_argument("--heads", type=positive_int, default=None, help="attention heads (default: hidden / 128)")
    p.add_argument("--vocab", type=positive_int, default=None, help="vocabulary size (adds the logits)")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each layer in backward")
    p.add_argument("--attention", choices=PLAN_ATTENTION, default="eager",
                   help="eager stores the attention scores (the paper's 5as/h term); fused (FlashAttention, SDPA) "
                   "does not (default: %(default)s)")
    p.add_argument("--sequence-parallel", action="store_true", help="tensor-parallel candidates use sequence "
                   "parallel")
    p.add_argument("--strategy", default="auto",
                   help="estimate this strategy string instead of choosing (e.g. zero3, fsdp:hybrid_shard, "
                   "3d:dp=2,tp=2,pp=2, or with context and expert parallel 5d:dp=2,cp=2,ep=4,tp=1,pp=1)")
    p.add_argument("--expert-params", type=_param_count, default=None,
                   help="of --params, the parameters inside the experts of a mixture of experts (all experts of "
                   "every MoE layer; routers excluded): what ep splits (default: the --model's MoE layers, else 0)")
    p.add_argument("--experts", type=positive_int, default=None,
                   help="experts per MoE layer (with --expert-params: checks ep divides it, sizes the all-to-alls)")
    p.add_argument("--experts-per-token", type=positive_int, default=None,
                   help="experts each token is routed to (with --experts: sizes the ep all-to-alls)")
    p.add_argument("--no-offload", action="store_true", help="never recommend CPU offload")
    p.add_argument("--intra-node-gbps", type=positive_float, default=150.0,
                   help="GB/s between GPUs of a node (default: %(default)s)")
    p.add_argument("--inter-node-gbps", type=positive_float, default=12.5,
                   help="GB/s between nodes (default: %(default)s, 100 Gb/s)")
    p.set_defaults(handler=functools.partial(_run_plan, p))


def _run_plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if (args.params is None) == (args.model is None):
        parser.error("give exactly one of --params or --model")
    if (args.seq is None) != (args.batch is None):
        parser.error("--seq and --batch go together (activations need both)")
    experts_given = [f"--{n.replace('_', '-')}" for n in ("expert_params", "experts", "experts_per_token")
                     if getattr(args, n) is not None]
    if args.model is not None and experts_given:
        parser.error(f"{', '.join(experts_given)} describe the experts of --params; --model gives its own")
    if args.expert_params is None and experts_given:
        parser.error(f"{', '.join(experts_given)} need --expert-params (the parameters inside the experts)")
    if args.expert_params is not None and args.expert_params > args.params:
        parser.error(f"--expert-params {args.expert_params:g} exceeds --params {args.params:g}")
    if args.experts and args.experts_per_token and args.experts_per_token > args.experts:
        parser.error(f"--experts-per-token {args.experts_per_token} exceeds --experts {args.experts}")
    node = args.gpus_per_node or min(args.gpus, 8)
    if node > args.gpus or args.gpus % node:
        parser.error(f"--gpus-per-node {node} must divide --gpus {args.gpus}")
    import importlib

    from shardwise.estimate import activation_geometry  # torch: only now that the command line is known to be good
    from shardwise.planner import Links, Workload, costs, model_facts, plan

    model, psi, facts = None, args.params, None
    if args.model is not None:
        module, _, name = args.model.partition(":")
        try:
            model = getattr(importlib.import_module(module), name)()
        except Exception as exc:  # noqa: BLE001 - the user's code: one line naming what failed
            return fail("plan", f"cannot build --model {args.model}: {type(exc).__name__}: {exc}")
        facts = model_facts(model)
        psi = facts.num_params
    geometry = None
    if args.seq is not None:
        geometry = activation_geometry(model, psi, args.seq, args.batch, hidden_size=args.hidden,
                                       num_layers=args.layers, num_heads=args.heads, vocab_size=args.vocab)
    hidden = args.hidden or (facts.hidden_size if facts else None)
    experts = None
    if facts is not None and facts.expert_params:
        experts = costs.Experts(facts.expert_params, facts.n_experts, facts.experts_per_token, facts.moe_layers)
    elif args.expert_params is not None:
        experts = costs.Experts(args.expert_params, args.experts or 0, args.experts_per_token or 0)
    work = Workload(psi, args.dtype, args.optimizer, geometry, args.activation_checkpointing, args.attention,
                    args.sequence_parallel, hidden, experts)
    links = Links(args.gpus, node, args.gpu_mem * 1e9, intra_node_gbps=args.intra_node_gbps,
                  inter_node_gbps=args.inter_node_gbps)
    allowed = {"offload": not args.no_offload}
    if facts is not None:
        allowed.update(tensor_parallel=facts.tp_plan is not None,  # MoE: experts kept whole on each tp rank
                       pipeline=facts.pipeline_layers is not None and not facts.moe_balance_loss,
                       max_pp=facts.pipeline_layers)
    try:
        result = plan(work, links, strategy=args.strategy, **allowed)
    except ValueError as exc:  # an unknown strategy string, sizes that do not divide, or nothing fits
        return fail("plan", str(exc))
    print(result.explain())
    return 0

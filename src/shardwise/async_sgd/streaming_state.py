"""Streaming DiLoCo's state declared to whole-model tools (layout.py), so `sw.save_checkpoint` carries it.

Two extra states:
* "local_sgd", replicated (equal on every rank: written once): the counters, the anchors, each fragment's outer
  optimizer state and the synchronisations in flight: the averaged result of each (a save waits for it; the
  all-reduce gave every rank the same) and the inner step at which it is applied. Flat keys: "inner_steps",
  "syncs", "anchor/<parameter>", "outer/<f>/param_groups", "outer/<f>/state/<index>/<key>", "pending/<f>/due",
  "pending/<f>/<k>" (k: the fragment's dtype group).
* "local_sgd_params", per rank: this worker's own parameters and floating-point buffers. Between synchronisations
  (and always, with fragments or mixing) the workers' values differ; the model's copy in the checkpoint is one
  rank's, so without these a resumed run would restart every worker from that one. Reloads onto the same world
  size (a different one needs `reset_strategy_state=True`: every worker then starts from the saved model copy).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import layout
from ..comm.base import Communicator
from .checks import check_anchor_names
from .extra_state import follows_steps

__all__ = ["check_outer", "declare_streaming", "flatten_streaming", "unflatten_streaming"]


def flatten_streaming(saved: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {"inner_steps": saved["inner_steps"], "syncs": saved["syncs"]}
    flat.update({f"anchor/{name}": a for name, a in saved["anchors"].items()})
    for f, outer in enumerate(saved["outer_optimizers"]):
        flat[f"outer/{f}/param_groups"] = outer["param_groups"]
        for index, per_param in outer["state"].items():
            flat.update({f"outer/{f}/state/{index}/{key}": value for key, value in per_param.items()})
    for f, pending in saved["pending"].items():
        flat[f"pending/{f}/due"] = pending["due"]
        flat.update({f"pending/{f}/{k}": t for k, t in enumerate(pending["flats"])})
    return flat


def unflatten_streaming(flat: dict[str, Any]) -> dict[str, Any]:
    """The nested form `load_outer_state_dict` takes; ValueError naming a key it cannot place."""
    saved: dict[str, Any] = {"anchors": {}, "outer_optimizers": [], "pending": {}}
    outers: dict[int, dict[str, Any]] = {}
    pending: dict[int, dict[str, Any]] = {}
    for key, value in flat.items():
        parts = key.split("/")
        if key in ("inner_steps", "syncs"):
            saved[key] = value
        elif parts[0] == "anchor" and len(parts) > 1:
            saved["anchors"][key[len("anchor/"):]] = value
        elif parts[0] == "outer" and len(parts) == 3 and parts[1].isdigit() and parts[2] == "param_groups":
            outers.setdefault(int(parts[1]), {"state": {}})["param_groups"] = value
        elif parts[0] == "outer" and len(parts) == 5 and parts[1].isdigit() and parts[2] == "state" \
                and parts[3].isdigit():
            outers.setdefault(int(parts[1]), {"state": {}})["state"].setdefault(int(parts[3]), {})[parts[4]] = value
        elif parts[0] == "pending" and len(parts) == 3 and parts[1].isdigit() and (parts[2] == "due"
                                                                                    or parts[2].isdigit()):
            entry = pending.setdefault(int(parts[1]), {"flats": {}})
            if parts[2] == "due":
                entry["due"] = value
            else:
                entry["flats"][int(parts[2])] = value
        else:
            raise ValueError(f"streaming DiLoCo state: unknown entry {key!r} (allowed: inner_steps, syncs, "
                             f"anchor/<name>, outer/<f>/param_groups, outer/<f>/state/<index>/<key>, "
                             f"pending/<f>/due, pending/<f>/<k>)")
    if sorted(outers) != list(range(len(outers))) or any("param_groups" not in o for o in outers.values()):
        raise ValueError(f"streaming DiLoCo state: outer optimizer entries for fragments {sorted(outers)}, each "
                         f"needs outer/<f>/param_groups and the fragments must be 0 .. F-1")
    saved["outer_optimizers"] = [outers[f] for f in range(len(outers))]
    for f, entry in pending.items():
        if "due" not in entry or sorted(entry["flats"]) != list(range(len(entry["flats"]))):
            raise ValueError(f"streaming DiLoCo state: the synchronisation in flight of fragment {f} needs "
                             f"pending/{f}/due and pending/{f}/0 .. pending/{f}/<k>")
        saved["pending"][f] = {"due": entry["due"], "flats": [entry["flats"][k] for k in range(len(entry["flats"]))]}
    return saved


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_outer(module: nn.Module, saved: dict[str, Any]) -> None:
    """ValueError unless `saved` (nested form) fits `module`'s streaming wrapper; changes nothing."""
    state = module._local_sgd
    who = "streaming DiLoCo state"
    for key in ("inner_steps", "syncs"):
        if not _int(saved.get(key)) or saved[key] < 0:
            raise ValueError(f"{who}: {key}={saved.get(key)!r} must be a non-negative int")
    for key, mine in (("sync_every", state.sync_every), ("fragments", len(state.fragments)),
                      ("overlap_steps", state.overlap)):
        if key in saved and saved[key] != mine:
            raise ValueError(f"{who}: saved with {key}={saved[key]!r}, this StreamingDiLoCo has {key}={mine}")
    anchors = saved.get("anchors", {})
    check_anchor_names(anchors, state.names, who)
    for name, like in zip(state.names, state.anchors):
        a = anchors[name]
        if not isinstance(a, torch.Tensor) or a.shape != like.shape or a.dtype != like.dtype:
            raise ValueError(f"{who}: anchor {name!r} must be a {tuple(like.shape)} {like.dtype} tensor")
    outers = saved.get("outer_optimizers")
    if not isinstance(outers, list) or len(outers) != len(state.fragments):
        raise ValueError(f"{who}: {len(outers) if isinstance(outers, list) else outers!r} outer optimizer states for "
                         f"{len(state.fragments)} fragments")
    for frag, outer in zip(state.fragments, outers):
        if not isinstance(outer.get("param_groups"), list) or len(outer["param_groups"]) != 1 or any(
                not _int(i) or not 0 <= i < len(frag.params) for i in outer.get("state", {})):
            raise ValueError(f"{who}: fragment {frag.index}'s outer optimizer state does not fit its "
                             f"{len(frag.params)} parameters")
    pending = saved.get("pending", {})
    for f, entry in pending.items():
        if not _int(f) or not 0 <= f < len(state.fragments):
            raise ValueError(f"{who}: a synchronisation in flight for fragment {f!r}; allowed: 0 to "
                             f"{len(state.fragments) - 1}")
        due = entry.get("due")
        if not _int(due) or not saved["inner_steps"] < due <= saved["inner_steps"] + state.overlap:
            raise ValueError(f"{who}: fragment {f}'s synchronisation in flight is due at step {due!r}, outside "
                             f"({saved['inner_steps']}, {saved['inner_steps'] + state.overlap}]")
        frag = state.fragments[f]
        n = len(state.params)
        want = [(sum((state.params[i] if i < n else state.buffers[i - n]).numel() for i in g),
                 (state.params[g[0]] if g[0] < n else state.buffers[g[0] - n]).dtype) for g in frag.groups]
        got = entry.get("flats", [])
        if len(got) != len(want) or any(not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != k
                                        or t.dtype != d for t, (k, d) in zip(got, want)):
            raise ValueError(f"{who}: fragment {f}'s synchronisation in flight must be {len(want)} flat tensor(s) "
                             f"of {[k for k, _ in want]} elements ({[str(d) for _, d in want]})")


def _local_values(module: nn.Module) -> dict[str, torch.Tensor]:
    state = module._local_sgd
    out = {f"param/{n}": p.detach() for n, p in zip(state.names, state.params)}
    out.update({f"buffer/{n}": b.detach() for n, b in zip(state.buffer_names, state.buffers)})
    return out


def _check_local(module: nn.Module, flat: dict[str, Any]) -> None:
    mine = _local_values(module)
    if sorted(flat) != sorted(mine):
        raise ValueError(f"streaming DiLoCo local values: {len(flat)} entries for this model's {len(mine)} "
                         f"(param/<name>, buffer/<name>)")
    for key, like in mine.items():
        t = flat[key]
        if not isinstance(t, torch.Tensor) or t.shape != like.shape or t.dtype != like.dtype:
            raise ValueError(f"streaming DiLoCo local values: {key!r} must be a {tuple(like.shape)} {like.dtype} "
                             f"tensor")


@torch.no_grad()
def _load_local(module: nn.Module, flat: dict[str, Any]) -> None:
    if not flat:  # reset_strategy_state: every worker continues from the checkpoint's model copy
        return
    for key, live in _local_values(module).items():
        live.copy_(flat[key])


def declare_streaming(module: nn.Module, comm: Communicator, options: dict[str, Any]) -> None:
    """Declare `module`'s Streaming DiLoCo (just wrapped) to the layout contract: replicated outer state and each
    worker's own values."""
    before = layout.placements(module)
    outer = layout.ExtraState(
        "local_sgd", "replicated",
        state_dict=lambda: flatten_streaming(module.outer_state_dict()),
        load_state_dict=lambda flat: module.load_outer_state_dict(unflatten_streaming(flat)),
        check=lambda flat: check_outer(module, unflatten_streaming(flat)),
        config={"outer_optimizer": "SGD", "sync_every": options["sync_every"], "fragments": options["fragments"],
                "overlap_steps": options["overlap_steps"], "pattern": options["pattern"]},
        group=comm)
    local = layout.ExtraState(
        "local_sgd_params", "per_rank",
        state_dict=lambda: _local_values(module),
        load_state_dict=lambda flat: _load_local(module, flat),
        check=lambda flat: _check_local(module, flat),
        config={"values": len(_local_values(module))},
        group=comm)
    extra = [follows_steps(outer, module), local]  # a skipped inner step is not counted (extra_state.py)
    if module.compressor is not None:  # the outer gradients' error-feedback memory: each rank's own
        extra.append(module.compressor.extra_state(comm, follows_gradients=False,
                                                    buckets=module._local_sgd.compressed_buckets()))
    layout.declare(module, layout.Parallelized("local_sgd", (), before, options=options, extra_state=tuple(extra)))

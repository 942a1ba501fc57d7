"""Writing into a piece through an index of the whole tensor: ``w[pad] = 0``, ``init.zeros_(w[pad])``.

A script that edits some rows or columns of a parameter after wrapping indexes what `model.parameters()` yields,
under ZeRO / FSDP / tensor or expert parallel this rank's piece: HuggingFace's ``_init_weights`` zeroes an
embedding's padding row with ``init.zeros_(module.weight[module.padding_idx])``, a script sets
``emb.weight.data[pad_id] = 0`` or re-draws one row with ``w[i].normal_()``. The index names elements of the whole
tensor (the piece answers for its shape, sharded_tensor.py); taken on the piece's flat storage it would select
other elements, or none. Here the index keeps its meaning:

* ``piece[index] = value`` writes ``value`` (broadcast over the selection as torch broadcasts it) into the elements
  of the selection that this rank holds (`write_selection`);
* ``piece[index]`` returns a :class:`WholeSelection`: a tensor of the selection's shape whose values are not here
  (no rank has them all). Overwriting it (``zero_``, ``fill_``, ``copy_(plain)``, the random fills, torch.nn.init's
  initialisers, which HuggingFace's ``init`` module calls) computes the selection as one process would, random fills
  drawing the selection's count of numbers from the generator as one process draws them, and writes it through to
  the piece; once written, further in-place operations on it (``trunc_normal_``'s ``erfinv_`` / ``mul_`` /
  ``clamp_`` after its ``uniform_``) write through as well. Reading it before it is written is refused. An index
  of tensors or masks gives a copy in one process (``w[ids].zero_()`` changes a copy, not ``w``): the selection
  is then written without reaching the piece, as there.

The elements a rank holds come from `ShardSpec.held` (the placement its strategy declared, layout.py). A basic
index (integers and slices) is intersected with each held box directly; any other index (tensors, masks) is
expanded to a whole-shaped mask and values, one whole-size temporary per write, as the random fills of
sharded_whole.py cost. In-place writes with autograd recording are refused as one process refuses them on a leaf
that requires grad: write under ``torch.no_grad()``, as the initialisers do.
"""

from __future__ import annotations

from typing import Any

import torch

from .boxes import Box, box_slices
from .sharded_whole import RANDOM_FILLS, is_initialiser

__all__ = ["WholeSelection", "indexes_whole", "select_whole", "set_whole", "write_selection"]

#: operations that overwrite every element of their target without reading it
_OVERWRITES = frozenset({"zero_", "fill_", "copy_"}) | RANDOM_FILLS
#: what may be asked of a selection whose values are not here: its metadata, and new tensors shaped or typed like it
_METADATA = frozenset({"__get__", "size", "dim", "numel", "__len__", "is_floating_point", "is_complex", "stride",
                       "element_size", "is_contiguous", "requires_grad_", "new_tensor", "new_empty", "new_zeros",
                       "new_ones", "new_full", "empty_like", "zeros_like", "ones_like", "full_like"})


def indexes_whole(spec: Any, index: Any) -> bool:
    """Whether indexing a piece of `spec` with `index` selects from the whole tensor here: a piece (not a whole
    tensor) whose place is known, and an index holding no piece (a mask computed from a piece, Rprop's
    ``grad[sign < 0] = 0``, selects elementwise and runs on the piece as it is)."""
    items = index if isinstance(index, tuple) else (index,)
    return (not spec.whole and spec.held is not None
            and not any(isinstance(i, torch.Tensor) and type(i) not in (torch.Tensor, torch.nn.Parameter)
                        for i in items))


def _refuse_recording(piece: Any, spec: Any, what: str) -> None:
    if torch.is_grad_enabled() and piece.requires_grad:
        raise RuntimeError(f"{what} on {spec.name} writes in place into a parameter that requires grad while "
                           f"autograd records (one process raises the same for a leaf): write under torch.no_grad()")


def _basic(index: Any, shape: torch.Size) -> list[int | slice] | None:
    """`index` as one int or step-1..n slice per dim of `shape` (normalised, non-negative), or None when it is not
    basic (tensors, lists, masks, None, negative steps): those take the whole-shaped path."""
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(i is Ellipsis for i in items) > 1:
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (len(shape) - len(items) + 1)
    if len(items) > len(shape):
        return None
    items += [slice(None)] * (len(shape) - len(items))
    out: list[int | slice] = []
    for item, n in zip(items, shape):
        if isinstance(item, bool) or not isinstance(item, (int, slice)):
            return None
        if isinstance(item, int):
            if not -n <= item < n:
                return None  # torch's own error, from the whole-shaped path
            out.append(item % n)
        else:
            start, stop, step = item.indices(n)
            if step < 1:
                return None
            out.append(slice(start, max(start, stop), step))
    return out


def _selection_shape(shape: torch.Size, index: Any) -> torch.Size:
    """The shape of ``whole[index]`` for a whole tensor of `shape` (torch's indexing rules, on a 0-stride tensor)."""
    return torch.empty((), dtype=torch.bool).expand(shape)[index].shape


def _box_part(box: Box, basic: list[int | slice]) -> tuple[tuple, tuple] | None:
    """(index into the box's view, index into the selection) of the elements of `box` the basic index selects; None
    when it selects none there."""
    local, chosen = [], []
    for (lo, size), item in zip(box, basic):
        hi = lo + size
        if isinstance(item, int):
            if not lo <= item < hi:
                return None
            local.append(item - lo)
            continue
        start, stop, step = item.start, item.stop, item.step
        first = max(0, -(-(lo - start) // step))            # the first k with start + k step >= lo
        last = min(len(range(start, stop, step)), -(-(hi - start) // step))  # the first k with start + k step >= hi
        if first >= last:
            return None
        local.append(slice(start + first * step - lo, start + (last - 1) * step - lo + 1, step))
        chosen.append(slice(first, last))
    return tuple(local), tuple(chosen)


def write_selection(piece: Any, spec: Any, plain: torch.Tensor, index: Any, value: Any) -> None:
    """Set this rank's elements of ``whole[index]`` to `value` (a number or plain tensor broadcast to the selection);
    `plain` is the piece's own storage (`local(piece)`)."""
    shape = torch.Size(spec.shape)
    selection = _selection_shape(shape, index)
    values = torch.as_tensor(value, dtype=plain.dtype, device=plain.device).expand(selection)
    basic = _basic(index, shape)
    with torch.no_grad():
        if basic is not None:
            for box, view in spec.held(plain):
                part = _box_part(box, basic)
                if part is not None:
                    view[part[0]] = values[part[1]]
            return
        mask = torch.zeros(shape, dtype=torch.bool, device=plain.device)
        mask[index] = True
        whole = torch.zeros(shape, dtype=plain.dtype, device=plain.device)
        whole[index] = values
        for box, view in spec.held(plain):
            where = box_slices(box)
            view.copy_(torch.where(mask[where], whole[where], view))


class WholeSelection(torch.Tensor):
    """``piece[index]``: the selection of the whole tensor `index` names, to overwrite (module docstring). Its
    storage is a placeholder of the selection's shape; `_target` is (piece, spec, plain storage, index)."""

    _target: tuple
    _written: bool
    _view: bool  # a basic index: one process's `w[i]` is a view of w, and writes to it reach the parameter

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        target = args[0] if args else kwargs.get("tensor")
        if name in _METADATA:
            return _not_a_view(_plain(func, args, kwargs), args, name)
        values = (*args, *kwargs.values())
        foreign = next((a for a in values if isinstance(a, torch.Tensor) and not isinstance(a, WholeSelection)
                        and type(a) not in (torch.Tensor, torch.nn.Parameter)), None)
        if foreign is not None:  # a piece: under torch function disabled its flat storage would meet the selection
            _, spec, _, index = next(a for a in values if isinstance(a, WholeSelection))._target
            raise RuntimeError(f"{name}() combines {spec.name}[{_describe(index)}], a selection of a {spec.what} "
                               f"piece, with a {type(foreign).__name__}; combine it with plain tensors and numbers")
        mine = isinstance(target, WholeSelection)
        others = [a for a in (*args[1:], *kwargs.values()) if a is not target]
        if mine and (name in _OVERWRITES or is_initialiser(func)) and not any(_unknown(a) for a in others):
            return _write_through(target, func, args, kwargs, name)
        if mine and target._written and _in_place(name) and not any(_unknown(a) for a in others):
            return _write_through(target, func, args, kwargs, name)
        unknown = next((a for a in (*args, *kwargs.values()) if _unknown(a)), None)
        if unknown is None:
            return _not_a_view(_plain(func, args, kwargs), args, name)
        piece, spec, _, index = unknown._target
        raise RuntimeError(
            f"{name}() reads {spec.name}[{_describe(index)}], a selection of a {spec.what} piece answering for the "
            f"whole tensor, whose values this rank does not have: writes through the index work (p[i] = v, "
            f"p[i].zero_(), init.normal_(p[i]), under torch.no_grad()); to read, sw.full_state_dict(model) "
            f"(collective)")


def _not_a_view(out: Any, args: tuple, name: str) -> Any:
    """`out`, unless it shares a selection's storage (``w[0][3]``, ``w[0].T``, ``w[0].data``): a write to such a view
    would reach the placeholder and not the piece, so it is refused."""
    outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    if not outs:
        return out
    with torch._C.DisableTorchFunctionSubclass():
        mine = {s.untyped_storage().data_ptr() for s in args if isinstance(s, WholeSelection) and s.numel()}
        shared = [t for t in outs if t.numel() and t.untyped_storage().data_ptr() in mine]
    if shared:
        _, spec, _, index = next(s for s in args if isinstance(s, WholeSelection))._target
        raise RuntimeError(f"{name}() of {spec.name}[{_describe(index)}], a selection of a {spec.what} piece, would "
                           f"be a view of it, through which writes would not reach the piece: index the parameter "
                           f"once (p[i, j] rather than p[i][j]) and write to that selection")
    return out


def _in_place(name: str) -> bool:
    """Whether the operation named so writes into its first argument: `mul_`, `__setitem__`, `__imul__`."""
    if name.startswith("__") and name.endswith("__"):
        return name == "__setitem__" or (name[2] == "i" and name[3:-2] in _BINARY)
    return name.endswith("_")


_BINARY = frozenset({"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift",
                     "rshift", "matmul"})


def _unknown(a: Any) -> bool:
    return isinstance(a, WholeSelection) and not a._written


def _plain(func: Any, args: tuple, kwargs: dict) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _write_through(selection: WholeSelection, func: Any, args: tuple, kwargs: dict, name: str) -> Any:
    piece, spec, plain, index = selection._target
    _refuse_recording(piece, spec, f"{name}() of {spec.name}[{_describe(index)}]")
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **kwargs)
        values = selection.as_subclass(torch.Tensor)
    if selection._view:
        write_selection(piece, spec, plain, index, values)
    selection._written = True
    return selection if out is selection or _in_place(name) else out


def _describe(index: Any) -> str:
    items = index if isinstance(index, tuple) else (index,)
    return ", ".join("..." if i is Ellipsis else f"tensor{tuple(i.shape)}" if isinstance(i, torch.Tensor)
                     else str(i) for i in items)


def set_whole(piece: Any, spec: Any, plain: torch.Tensor, index: Any, value: Any) -> None:
    """``piece[index] = value`` for a piece answering for the whole tensor (`write_selection`)."""
    _refuse_recording(piece, spec, f"{spec.name}[{_describe(index)}] = ...")
    if _unknown(value):
        raise RuntimeError(f"{spec.name}[{_describe(index)}] = an unwritten selection of a piece: its values are not "
                           f"here; assign a plain tensor or a number")
    if isinstance(value, WholeSelection):
        value = value.as_subclass(torch.Tensor)
    write_selection(piece, spec, plain, index, value)


def select_whole(piece: Any, spec: Any, plain: torch.Tensor, index: Any) -> WholeSelection:
    """``piece[index]`` for a piece answering for the whole tensor: a :class:`WholeSelection` to overwrite. A basic
    index (integers, slices) gives a view in one process, so writes reach the parameter, and its placeholder has the
    view's strides (torch's random fills order their draws by memory layout: a column block draws other numbers than
    a contiguous block); any other index gives a copy in one process, written without reaching the parameter."""
    shape = torch.Size(spec.shape)
    if any(i is None for i in (index if isinstance(index, tuple) else (index,))):
        raise RuntimeError(f"{spec.name}[{_describe(index)}]: None (a new axis) in an index of a piece is not "
                           f"supported; index without it")
    view = _basic(index, shape) is not None
    if view:
        like = torch.empty(shape, device="meta")[index]
        placeholder = torch.empty_strided(like.shape, like.stride(), dtype=plain.dtype, device=plain.device)
    else:
        placeholder = torch.empty(_selection_shape(shape, index), dtype=plain.dtype, device=plain.device)
    out = torch.Tensor._make_subclass(WholeSelection, placeholder, piece.requires_grad)
    out._target, out._written, out._view = (piece, spec, plain, index), False, view
    return out

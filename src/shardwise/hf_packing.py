"""Whether a HuggingFace decoder keeps packed documents apart, as the pipeline stages and context parallel do.

Packed rows hold several documents, marked by position ids that restart at each one (``DataCollatorWithFlattening``).
transformers keeps the documents apart, with eager and SDPA attention, only inside its mask functions
(``create_causal_mask`` and its sliding-window and chunked kin find the documents from ``position_ids``), so only in
a model whose forward passes them its position ids. Most decoders do; some build their mask without them (GPT-OSS,
AFMoE, Falcon, OPT in transformers 5.x): with eager or SDPA attention one process then attends across the documents
of a packed row, while the pipeline stages (models/hf_stage_inputs.CausalMasks) and ring / Ulysses attention
(context_parallel/documents.py) keep them apart, as transformers itself does under flash attention, by design
(docs/context_parallel.md, "Packed sequences"). `sw.check` of such packed rows differs from its eager reference at the
first loss; its report says why, naming the module (check/sequences.packed_rows_note).

`mask_without_positions` reads it from the code: the first module whose forward calls a mask function (directly, or
through a name bound to one, as Mistral's ``mask_function``) without ``position_ids`` (a keyword, or a key of the
``**mask_kwargs`` dict it unpacks). A forward with no mask function at all is not counted.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

from torch import nn

__all__ = ["mask_without_positions"]

#: transformers' mask functions that find packed documents from position_ids (masking_utils)
MASK_FUNCTIONS = frozenset({"create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask"})


def mask_without_positions(model: nn.Module) -> str | None:
    """``"name (Class)"`` of the first module of `model` whose forward builds its causal mask without the position
    ids (module docstring), None when none does."""
    from .experts.hf_kinds import model_forward, unwrapped

    for name, module in model.named_modules():
        if _builds_mask_without_positions(unwrapped(model_forward(module))):
            return f"{name or 'the model'} ({type(module).__name__})"
    return None


@functools.lru_cache(maxsize=None)
def _builds_mask_without_positions(forward: Any) -> bool:
    code = getattr(forward, "__code__", None)
    if code is None or not MASK_FUNCTIONS & set(code.co_names):
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):  # no source to read: nothing to say
        return False
    bound = _names_bound_to_mask_functions(tree)
    dicts = _dicts_with_keys(tree)
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call) or not (isinstance(call.func, ast.Name) and call.func.id in bound):
            continue
        keys = {k.arg for k in call.keywords if k.arg is not None}
        for unpacked in (k.value for k in call.keywords if k.arg is None):
            keys |= dicts.get(unpacked.id, set()) if isinstance(unpacked, ast.Name) else set()
        if "position_ids" not in keys:
            return True
    return False


def _names_bound_to_mask_functions(tree: ast.AST) -> set[str]:
    """The mask functions' own names and the local names assigned an expression naming one of them."""
    bound = set(MASK_FUNCTIONS)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(n, ast.Name) and n.id in MASK_FUNCTIONS
                                                for n in ast.walk(node.value)):
            bound |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return bound


def _dicts_with_keys(tree: ast.AST) -> dict[str, set[str]]:
    """Local names assigned a dict, with the string keys it holds: a literal (``{**other, ...}`` too), ``dict(...)``,
    or a copy of another (Gemma 3's ``sliding_mask_kwargs = mask_kwargs.copy()``), in source order."""
    out: dict[str, set[str]] = {}
    assigns = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Assign) and len(n.targets) == 1
                      and isinstance(n.targets[0], ast.Name)), key=lambda n: (n.lineno, n.col_offset))
    for node in assigns:
        keys = _keys_of(node.value, out)
        if keys is not None:
            out.setdefault(node.targets[0].id, set()).update(keys)
    return out


def _keys_of(value: ast.AST, known: dict[str, set[str]]) -> set[str] | None:
    """The string keys of the dict `value` builds (None: not a dict this can read)."""
    if isinstance(value, ast.Dict):
        keys = {k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        for k, v in zip(value.keys, value.values):
            if k is None and isinstance(v, ast.Name):  # {**other}
                keys |= known.get(v.id, set())
        return keys
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict":
        keys = {k.arg for k in value.keywords if k.arg is not None}
        for arg in value.args:
            keys |= known.get(arg.id, set()) if isinstance(arg, ast.Name) else set()
        return keys
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "copy" \
            and isinstance(value.func.value, ast.Name) and value.func.value.id in known:
        return set(known[value.func.value.id])
    return None

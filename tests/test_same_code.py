"""experts.hf_kinds.same_code, which decides whether a model runs a forward shardwise knows (pipeline stages, expert
and tensor parallel): byte code, names and constants equal, docstrings aside, and nested functions (lambdas,
comprehensions) compared by their code, not by the file and line they were compiled at, which transformers'
generated families differ in (Laguna's and Mellum's mask functions)."""

from __future__ import annotations

from shardwise.experts.hf_kinds import same_code

SOURCE = '''
def forward(x, kinds):
    """{doc}"""
    {pad}
    make = {{"full": lambda: x + {one}, "sliding": lambda: x * 2}}
    return [make[k]() for k in kinds]
'''


def compiled(filename: str, doc: str = "", pad: str = "pass", one: int = 1, line: int = 1):
    scope: dict = {}
    source = "\n" * (line - 1) + SOURCE.format(doc=doc, pad=pad, one=one)
    exec(compile(source, filename, "exec"), scope)  # noqa: S102
    return scope["forward"]


def test_the_same_forward_compiled_in_two_files_is_the_same_code():
    assert same_code(compiled("modeling_mellum.py", line=500),
                     compiled("modeling_laguna.py", doc="Laguna's docstring", line=550))


def test_a_different_constant_or_statement_is_not():
    assert not same_code(compiled("a.py"), compiled("b.py", one=2))  # inside a lambda
    assert not same_code(compiled("a.py"), compiled("b.py", pad="x = x"))

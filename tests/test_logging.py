"""Logging: `import shardwise` installs no handler; `sw.get_logger()` installs one rank-tagged handler, once; ranks
that launch() starts in processes tag their lines only when the parent opted in.

The checks need a fresh interpreter: pytest (and earlier tests) configure logging in this one, and a module once
imported cannot be imported for the first time again. Each interpreter costs seconds (importing torch), so ONE runs
them all, in the order a user's script would meet them: the import, a gloo launch before any opt-in, the opt-in,
then a second launch; each test below asserts on its part of that run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.multiprocess  # one interpreter, which launches 2 gloo ranks twice

_SCRIPT = """
import json, logging, sys
BEFORE = list(logging.getLogger().handlers)  # the root logger's, before shardwise is imported
import shardwise as sw


def body(comm):
    logging.getLogger("shardwise.test").warning("hello from %d", comm.rank)  # no get_logger() in the rank


def library_handlers():
    return sorted(name for name, logger in logging.Logger.manager.loggerDict.items()
                  if name.startswith("shardwise") and isinstance(logger, logging.Logger) and logger.handlers)


if __name__ == "__main__":
    facts = {
        "after_import": len(logging.getLogger("shardwise").handlers),
        "library_loggers_with_handlers": library_handlers(),
        "root_unchanged": logging.getLogger().handlers == BEFORE,
        "propagates": logging.getLogger("shardwise").propagate,
    }
    print("=== default", file=sys.stderr, flush=True)
    sw.launch(body, 2, backend="gloo", timeout=60)
    facts["after_default_launch"] = library_handlers()
    print("=== opt-in", file=sys.stderr, flush=True)
    sw.get_logger()
    facts["after_first_call"] = len(logging.getLogger("shardwise").handlers)
    sw.get_logger("shardwise.ddp")
    facts["after_second_call"] = len(logging.getLogger("shardwise").handlers)
    facts["root_unchanged_after_calls"] = logging.getLogger().handlers == BEFORE
    logging.getLogger("shardwise.ddp").warning("a library line")
    sw.launch(body, 2, backend="gloo", timeout=60)
    print(json.dumps(facts))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(facts, stderr before the opt-in, stderr after it) of the one interpreter."""
    script = tmp_path_factory.mktemp("logging") / "ranks.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr
    _, default, opt_in = proc.stderr.split("=== ")
    assert default.startswith("default") and opt_in.startswith("opt-in"), proc.stderr
    return json.loads(proc.stdout), default, opt_in


def test_import_installs_no_handler_and_get_logger_installs_one_once(run):
    facts, _, opt_in = run
    assert facts == {
        "after_import": 0,
        "library_loggers_with_handlers": [],
        "root_unchanged": True,
        "propagates": True,
        "after_default_launch": [],  # launching ranks is no opt-in either
        "after_first_call": 1,
        "after_second_call": 1,
        "root_unchanged_after_calls": True,
    }
    # The library's own logger now writes through the installed handler, tagged with the (unknown) rank.
    assert "[rank -] WARNING shardwise.ddp: a library line" in opt_in


@pytest.mark.parametrize("mode", ["opt-in", "default"])
def test_spawned_ranks_tag_lines_only_when_the_parent_opted_in(run, mode):
    _, default, opt_in = run
    stderr = opt_in if mode == "opt-in" else default
    for rank in (0, 1):
        tagged = f"[rank {rank}] WARNING shardwise.test: hello from {rank}"
        # Without the opt-in the line still appears, through Python's last-resort handler, untagged.
        assert (tagged in stderr) == (mode == "opt-in"), stderr
        assert f"hello from {rank}" in stderr, stderr

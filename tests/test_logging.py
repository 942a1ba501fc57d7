"""Logging: `import shardwise` installs no handler; `sw.get_logger()` installs one rank-tagged handler, once.

Each check runs in a fresh interpreter: pytest (and earlier tests) configure logging in this one, and a module once
imported cannot be imported for the first time again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

_IMPORT_THEN_OPT_IN = """
import json, logging, sys
root = logging.getLogger()
before = list(root.handlers)
import shardwise as sw
library = {name: len(logger.handlers) for name, logger in logging.Logger.manager.loggerDict.items()
           if name.startswith("shardwise") and isinstance(logger, logging.Logger)}
facts = {
    "after_import": len(logging.getLogger("shardwise").handlers),
    "library_loggers_with_handlers": sorted(name for name, count in library.items() if count),
    "root_unchanged": root.handlers == before,
    "propagates": logging.getLogger("shardwise").propagate,
}
sw.get_logger()
facts["after_first_call"] = len(logging.getLogger("shardwise").handlers)
sw.get_logger("shardwise.ddp")
facts["after_second_call"] = len(logging.getLogger("shardwise").handlers)
facts["root_unchanged_after_calls"] = root.handlers == before
logging.getLogger("shardwise.ddp").warning("a library line")
print(json.dumps(facts))
"""


def _run(*command: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_import_installs_no_handler_and_get_logger_installs_one_once():
    proc = _run("-c", _IMPORT_THEN_OPT_IN)
    facts = json.loads(proc.stdout)
    assert facts == {
        "after_import": 0,
        "library_loggers_with_handlers": [],
        "root_unchanged": True,
        "propagates": True,
        "after_first_call": 1,
        "after_second_call": 1,
        "root_unchanged_after_calls": True,
    }
    # The library's own logger now writes through the installed handler, tagged with the (unknown) rank.
    assert "[rank -] WARNING shardwise.ddp: a library line" in proc.stderr


_RANKS_INHERIT = """
import logging, sys
import shardwise as sw

def body(comm):
    logging.getLogger("shardwise.test").warning("hello from %d", comm.rank)  # no get_logger() in the rank

if __name__ == "__main__":
    if sys.argv[1] == "opt-in":
        sw.get_logger()
    sw.launch(body, 2, backend="gloo", timeout=60)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["opt-in", "default"])
def test_spawned_ranks_tag_lines_only_when_the_parent_opted_in(tmp_path, mode):
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(_RANKS_INHERIT))
    proc = _run(str(script), mode)
    for rank in (0, 1):
        tagged = f"[rank {rank}] WARNING shardwise.test: hello from {rank}"
        # Without the opt-in the line still appears, through Python's last-resort handler, untagged.
        assert (tagged in proc.stderr) == (mode == "opt-in"), proc.stderr
        assert f"hello from {rank}" in proc.stderr, proc.stderr

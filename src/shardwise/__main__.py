"""`python -m shardwise ...`: the same command line as the `shardwise` console script (see cli.py)."""

from shardwise.cli import main

# Guarded because gloo ranks are spawned processes that re-import the parent's main module.
if __name__ == "__main__":
    raise SystemExit(main())

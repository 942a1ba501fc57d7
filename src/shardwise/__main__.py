"""`python -m shardwise ...`: the same command line as the `shardwise` console script (see src/shardwise_cli/).

Running the package imports `shardwise/__init__.py` (and torch) first; the console script does not."""

from shardwise_cli import main

# Guarded because gloo ranks are spawned processes that re-import the parent's main module.
if __name__ == "__main__":
    raise SystemExit(main())

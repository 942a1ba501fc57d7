"""The `shardwise` command line, as `shardwise.cli`: the parser and its commands live in the top-level module
`shardwise_cli` (src/shardwise_cli/), which parses before anything imports torch; see its docstring."""

from shardwise_cli import build_parser, main

__all__ = ["main", "build_parser"]

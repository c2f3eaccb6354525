"""JSON Schemas of every command's --json (data files; see docs/cli.md)."""

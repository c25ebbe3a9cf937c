"""The commands: `mtp-canary`'s verbs, one module each, and `cli`, the list of them.

Each command module exposes `register(subparsers)` (its arguments; light imports only, so
`mtp-canary --help` stays fast) and `run(args) -> int` (the work; heavy imports inside).
The run machinery never imports a command module: commands sit on top of the wings.
"""

"""The phases of one run, each a small object over the run's context (rollout.run.context).

A phase has a `name`, `enabled(ctx)` (whether it runs, given the config and what earlier
phases found) and `run(ctx)` (does its work, commits what it found to the store, writes its
summary into `ctx.result`). The controller runs them in order:

    prepare, fleet, preflight, restore, accuracy, experiment, sweep, decide, progressive, finish

Phases never call each other; what one needs from another it reads from the context.
"""

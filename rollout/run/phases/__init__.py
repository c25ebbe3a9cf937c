"""The phases of one run, each a small object over the run's context (rollout.run.context).

A phase has a `name`, `enabled(ctx)` (whether it runs, given the config and what earlier
phases found) and `run(ctx)` (does its work, commits what it found to the store, writes its
summary into `ctx.result`, and returns `Decided` when it decided the run, else None). The
controller runs them in order:

    prepare, fleet, preflight, restore, accuracy, experiment, candidates, sweep, decide, progressive, finish

The controller alone records the run's decision (RunContext.record_decision, with what a phase
returned); a phase reads it through `ctx.decided` and `ctx.standing`, never writes it. The rules
that make a decision are pure functions in rollout.run.decision.

A phase module (one that defines a phase of the controller's list) imports no other phase module:
what two phases share lives in a helper module here (candidate_choice, web_ui, replica_watch, the
experiment loop, the progressive steps) or in rollout.run. tests/test_one_decision_writer.py holds
both rules.
"""

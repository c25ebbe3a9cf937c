"""The judge: (baseline data, canary data, config) -> verdicts, as pure functions of numbers.

Kayenta's rule, kept strictly: no I/O, no clocks and no state. The controller
calls the judges after every window (look k of ``max_looks`` planned looks)
with everything measured so far, and stops when ``verdicts.is_final`` says so.
The statistics live in ``rollout.judge.stats``; ``latency``, ``accuracy``,
``acceptance``, ``sample_ratio`` and ``goodput`` turn their intervals into verdicts (``looks``
holds what they share), ``experiment_looks`` is the experiment's look rule and
per-look judging (the controller, ``mtp-canary judge`` and calibration share it),
and ``guards`` judges the progressive phase's windows. ``rollout.calibration``
measures the error rates of all of it by simulation, through these functions:

* PASS      the confidence bound on the good side clears the threshold;
* FAIL      the bound on the bad side is past the threshold (or an
            always-valid early-stop rule fired);
* INCONCLUSIVE otherwise, and always when data is missing or too scarce.
  Missing data is never a pass.

Error control, in one place
---------------------------
Every interval is a repeated confidence interval over the planned looks
(alpha spending, see ``rollout.judge.stats``). The promote side of every gate is
tested at ``alpha``: PROMOTE needs *all* gates to pass, an intersection-union
test, so the false-promote rate is <= alpha without any multiplicity
correction (Berger 1982, "Multiparameter hypothesis testing and acceptance
sampling", Technometrics 24:295-300). The rollback side of the latency
guardrails is Holm-adjusted across the enabled guardrails, so adding a
guardrail does not multiply false rollbacks. The accuracy gate splits its
rollback-side alpha between the planned-look test and the always-valid
clear-regression rule (Bonferroni).

Directions: every latency ratio is canary / baseline (below 1 = canary
faster); the accuracy difference is baseline - canary (above 0 = canary
worse); error and divergence differences are canary - reference. Swapping the
arms mirrors every estimate and interval.

Import rule: modules here import only each other, numpy, scipy, pydantic and the
plain-data modules ``cluster.arms``, ``cluster.metrics`` and ``loadtests.records`` (and the percentile
helpers of ``loadtests.health``); nothing else of ``rollout``, nothing of Ray, HTTP or SQLite.
"""

"""Descriptive analysis of a run's data, beside the judge's verdicts: the load sweep and its
crossover, acceptance by slice, the speculative-depth advice, and the replay of stored looks
(`mtp-canary judge` and report.html share it). Nothing here decides a run.
"""

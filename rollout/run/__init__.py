"""The run: the controller, its context and its phases, the store that holds what each phase
found, and what watches a run while it goes (status, live metrics, progress, the weight hook).

Imports the record (to write decision.json and its renderings), the judge and the analysis;
never a command module.
"""

"""The error loadtests raises when its load or its records cannot be trusted.

Its own module so that both the swarm (which runs the load) and the records reader (which
every phase tails) raise the one type the controller turns into an infrastructure failure.
"""

from __future__ import annotations


class SwarmError(RuntimeError):
    """The run failed or its records are incomplete; the message names the cause and the logs."""

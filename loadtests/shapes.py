"""The Locust load shape that plays a `LoadProfile` (steps over levels, or a ramp).

Imports Locust: only the locustfile imports this module, and it imports the module,
not the class, because Locust takes every shape class it finds in a locustfile's
namespace as the one to run. The locustfile installs a `ProfileShape` on the master (or
the single local process) when `--mtp-steps` or `--mtp-ramp` is given.

Closed loop: the shape sets the users to level x level_users at each tick (Locust ticks
once a second). Open loop: the users stay at the cap (--users) for the whole profile,
and the global arrival schedule itself follows the level (`loadtests.arrivals`). Either
way the shape ends the test when the profile ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from locust import LoadTestShape

from loadtests.profiles import LoadProfile


class ProfileShape(LoadTestShape):
    # it reads --users (the open-loop cap): Locust should not warn that the option is ignored
    use_common_options = True

    def __init__(
        self,
        profile: LoadProfile,
        *,
        level_users: float | None,
        cap_users: int,
        origin: Callable[[], float | None],
    ) -> None:
        """level_users None: open loop (constant users = cap_users); `origin` gives the
        epoch time the plan started (the clock the workers tag levels with), or None
        before the test starts."""
        super().__init__()
        self.profile = profile
        self.level_users = level_users
        self.cap_users = cap_users
        self._origin = origin

    def elapsed_s(self) -> float:
        origin = self._origin()
        return time.time() - origin if origin is not None else self.get_run_time()

    def tick(self) -> tuple[int, float] | None:
        elapsed = self.elapsed_s()
        if elapsed >= self.profile.duration_s:
            return None
        if self.level_users is None:
            users = self.cap_users
        else:
            users = self.profile.users_at(elapsed, self.level_users)
        # reach the level within the tick
        return users, float(max(users, 1))

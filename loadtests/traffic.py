"""This process's share of the load test's traffic: which prompt, which arm, and when.

One `TrafficShare` per Locust process (worker or local run), shared by its users. The
global request sequence is cut into interleaved slots: the process in slot s of n sends
prompts s, s + n, s + 2n, ... and, in open loop, its share of the global arrival
schedule. Users take tickets one at a time; a user that is busy when its ticket's time
comes sends late, and the record shows by how much. With a load profile every request
is tagged with the level it was due at (open loop: its targeted time; closed loop: the
time it leaves), on the one clock the master's plan starts for every worker.

Two prompt sources change who takes what. Multi-turn sessions are partitioned by session,
not by prompt: the process in slot s owns sessions s, s + n, ...; a user keeps one
session (its `Conversation`) and sends its turns in order, each turn to every pinned arm
in turn (or, with arm_users, to its own arm), then takes the next session. A trace's
requests are due at the trace's times: every pinned arm gets each row at the row's time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loadtests.arrivals import ArrivalSchedule, arrival_schedule
from loadtests.datasets import Prompt, PromptSource, open_prompt_source
from loadtests.openai_stream import StreamRequest
from loadtests.options import TrafficOptions


@dataclass(frozen=True)
class SlotPlan:
    """Where this process sits in the partition, and when the schedule starts (epoch s)."""

    slot: int
    n_slots: int
    start_at: float

    def __post_init__(self) -> None:
        if self.n_slots < 1 or not 0 <= self.slot < self.n_slots:
            raise ValueError(f"slot {self.slot} is not in 0..{self.n_slots - 1}")


@dataclass(frozen=True)
class RequestTicket:
    """The next request a user should send."""

    sequence: int  # position in this process's request sequence
    prompt: Prompt
    request: StreamRequest
    scheduled_at: float | None  # open loop: the targeted send time


@dataclass
class Conversation:
    """A user's place in its multi-turn session (held by the user, advanced by its tickets)."""

    session: int | None = None  # this process's session number (None: no session yet)
    step: int = 0  # tickets taken in the session: turn = step // arms, arm = step % arms


class TrafficShare:
    def __init__(self, options: TrafficOptions, plan: SlotPlan, prompts: PromptSource | None = None) -> None:
        self.options = options
        self.plan = plan
        self.prompts = prompts if prompts is not None else open_prompt_source(
            options.dataset,
            path=options.dataset_path,
            input_tokens=options.input_tokens,
            output_tokens=options.synthetic_output_tokens,
            seed=options.seed,
            prefix_groups=options.prefix_groups,
            prefix_tokens=options.prefix_tokens,
            turns=options.turns,
            chat=options.endpoint == "chat",
            trace_format=options.trace_format,
            trace_speedup=options.trace_speedup,
        )
        # multi-turn: the turns of one session (1: every prompt stands alone)
        self.turns: int = getattr(self.prompts, "turns", 1)
        if self.prompts.has_chats and options.endpoint != "chat":
            raise ValueError("the dataset holds chat conversations: use --mtp-endpoint chat")
        self.profile = options.profile
        self.arrivals: ArrivalSchedule | None = None
        if options.rate is not None:
            self.arrivals = arrival_schedule(
                options.arrival,
                options.rate,
                plan.start_at,
                burstiness=options.burstiness,
                seed=options.seed,
                slot=plan.slot,
                n_slots=plan.n_slots,
                profile=self.profile,
            )
        # resolved once per process from /v1/models when the options name no model
        self.model: str | None = options.model
        self._issued = 0
        arms = options.pinned_arms
        self._users_by_arm = {arm: 0 for arm in arms}
        self._issued_by_arm = {arm: 0 for arm in arms}
        self._sessions_by_arm: dict[str | None, int] = {}

    def join(self) -> str | None:
        """A user starts: with `arm_users`, the arm it keeps (the one with the fewest users now)."""
        if not self.options.arm_users:
            return None
        arm = min(self._users_by_arm, key=lambda a: (self._users_by_arm[a], self.options.pinned_arms.index(a)))
        self._users_by_arm[arm] += 1
        return arm

    def leave(self, arm: str | None) -> None:
        if arm is not None and self._users_by_arm.get(arm, 0) > 0:
            self._users_by_arm[arm] -= 1

    def conversation(self) -> Conversation | None:
        """A new user's session holder (multi-turn sources only)."""
        return Conversation() if self.turns > 1 else None

    def next_ticket(self, user_arm: str | None = None, conversation: Conversation | None = None) -> RequestTicket:
        sequence = self._issued
        self._issued += 1
        arms = self.options.pinned_arms
        if conversation is not None:
            prompt_index, arm_number = self._next_turn(user_arm, conversation)
        else:
            if user_arm is not None:
                # the user keeps its arm; every arm walks the same prompts (prompt k is its k-th request), so
                # both arms see the same prompts while each carries the same number of streams
                prompt_number, arm_number = self._issued_by_arm[user_arm], arms.index(user_arm)
                self._issued_by_arm[user_arm] += 1
            else:
                # with pinned arms every prompt goes to each arm in turn: both arms see the same prompts
                prompt_number, arm_number = divmod(sequence, len(arms)) if arms else (sequence, 0)
            prompt_index = self.plan.slot + self.plan.n_slots * prompt_number
        prompt = self.prompts.prompt(prompt_index)
        request = StreamRequest(
            endpoint=self.options.endpoint,
            model=self.model,
            max_tokens=prompt.max_tokens or self.options.max_tokens,
            prompt=prompt.text,
            messages=prompt.messages,
            temperature=self.options.temperature,
            ignore_eos=prompt.ignore_eos if prompt.ignore_eos is not None else self.options.ignore_eos,
            pinned_arm=arms[arm_number] if arms else None,
        )
        if prompt.trace_offset_s is not None:
            scheduled_at: float | None = self.plan.start_at + prompt.trace_offset_s
        else:
            scheduled_at = self.arrivals.next_send_time() if self.arrivals is not None else None
        return RequestTicket(sequence=sequence, prompt=prompt, request=request, scheduled_at=scheduled_at)

    def _next_turn(self, user_arm: str | None, conversation: Conversation) -> tuple[int, int]:
        """The prompt and arm of a user's next turn: its session's turns in order, each to every
        arm it sends to; a finished session makes way for the next of this slot's sessions."""
        arms = self.options.pinned_arms
        user_arms: tuple[Any, ...] = (user_arm,) if user_arm is not None else (arms or (None,))
        if conversation.session is None or conversation.step >= self.turns * len(user_arms):
            # with arm_users each arm counts its own sessions: an arm's k-th session is every arm's
            conversation.session = self._sessions_by_arm.get(user_arm, 0)
            self._sessions_by_arm[user_arm] = conversation.session + 1
            conversation.step = 0
        turn, local_arm = divmod(conversation.step, len(user_arms))
        conversation.step += 1
        session = self.plan.slot + self.plan.n_slots * conversation.session
        arm = user_arms[local_arm]
        return session * self.turns + turn, arms.index(arm) if arm is not None else 0

    @property
    def ends_at(self) -> float | None:
        """With a profile, the epoch time the load ends: nothing is sent from then on."""
        return None if self.profile is None else self.plan.start_at + self.profile.duration_s

    def level_at(self, epoch_s: float) -> float | None:
        """The profile's level at a wall-clock time (None without a profile)."""
        if self.profile is None:
            return None
        return self.profile.level_at(epoch_s - self.plan.start_at)

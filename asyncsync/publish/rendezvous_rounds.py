"""The rules of :class:`~asyncsync.publish.rendezvous.FileRendezvous`'s rounds, without I/O:
which round rank 0's result answers (a rank reading it), which round a rank's message is for
(rank 0 taking it), and rank 0's record of a decided plan round. The state they read and keep
is the rendezvous's own (set in its ``__init__``); :class:`RoundRules` is the base it inherits
them from.
"""

from __future__ import annotations

import collections
import secrets

from asyncsync.errors import StepBehind
from asyncsync.publish.distributed import Message, step_behind, step_of


class RoundRules:
    """The round rules of :class:`~asyncsync.publish.rendezvous.FileRendezvous` (its base)."""

    rank: int
    timeout: float
    job: str
    _group: str | None  # the run of the group this rank is in
    _chain: str | None  # plans without step: the round this rank counts from
    _skip: int  # its calls since then that ended without learning their round
    _history: collections.deque[str]  # rank 0: the chained plan rounds it remembers
    _taken: collections.deque[str]  # rank 0: the nonces of the messages it took

    def _ours(self, rec: Message | None) -> bool:
        return rec is not None and (rec.get("group"), rec.get("job", "")) == (self._group, self.job)

    # ------------------------------------------------------------------ a rank, rank 0's result
    def _where(self, res: Message) -> str:
        """Where a plan result stands to this rank's chained round: "decided" (it is the
        result of our round), "passed" (rank 0 is past it) or "wait"."""
        hist, nxt = res.get("history"), res.get("id")
        keys = [*(hist if isinstance(hist, list) else [res.get("key")]), nxt]
        if self._chain not in keys:
            return "passed"  # older than what rank 0 remembers
        target, decided = keys.index(self._chain) + self._skip, len(keys) - 2
        return "decided" if target == decided else "passed" if target < decided else "wait"

    def _verdict(
        self, step: str, key: str | None, nonce: str, mine: int | None, seen: object,
        res: Message,
    ) -> str | StepBehind | None:  # fmt: skip
        """What rank 0's result ``res`` tells this call: None (not ours yet: wait), "ours" (the
        result of our round, with our message), or why this call failed."""
        if step != "plan":
            return "ours" if res.get("key") == key else None  # final for every rank
        chained, theirs = key is None, step_of(res.get("key"))
        if chained != (theirs is None):
            if not chained and res.get("id") == seen:
                return None  # older than our message
            return ("rank 0 passes step= to publish and this rank does not" if chained else
                    "this rank passes step= to publish and rank 0 does not") + ": pass the "\
                "same on every rank"  # fmt: skip
        if chained:
            where = self._where(res)
            if where == "wait":
                return None
            if where == "passed":
                return ("rank 0 is past the plan round this call came for (this rank came late "
                        "or missed rounds); the next publish joins the next round")  # fmt: skip
        else:
            assert mine is not None and theirs is not None
            if theirs < mine or (theirs == mine and res.get("id") == seen):
                return None
            if theirs > mine:
                return step_behind(self.rank, mine, theirs)
        if isinstance(res.get("group_step"), int):  # rank 0 told this rank it is behind
            return step_behind(self.rank, mine, res["group_step"])
        if res.get("aborted"):
            return f"rank 0 gave the plan round up: {res['aborted']}"
        if res.get("nonces", {}).get(str(self.rank)) != nonce:
            return ("rank 0 decided the plan round without this rank (it joined too late); "
                    "the next publish joins the next round")  # fmt: skip
        return "ours"

    # ------------------------------------------------------------------ rank 0, a rank's message
    def _take(self, m: Message | None, chained: bool, rkey: str | None, mine: int | None) -> str:
        """Whether rank 0 takes message ``m`` for its round: "ours", "stale" (an older round,
        another run, or already taken), "late" (a stepped message of an older step, its
        rank still waiting) or an error that fails the round (the rank moved past it)."""
        if m is None or not self._ours(m) or not isinstance(m.get("body"), dict):
            return "stale"
        if str(m.get("nonce")) in self._taken:
            return "stale"
        if mine is None and not chained:  # a commit
            return "ours" if m.get("key") == rkey else "stale"
        theirs = step_of(m.get("key")) if "skip" not in m else None
        if chained != (theirs is None):
            return (
                "it passes step= to publish and rank 0 does not"
                if chained
                else "rank 0 passes step= to publish and it does not"
            ) + ": pass the same on every rank"
        if mine is not None and theirs is not None:
            if theirs == mine:
                return "ours"
            if theirs > mine:  # rank 0 is the one behind: its call fails, the others wait
                raise step_behind(0, mine, theirs)
            return "late"
        hist = list(self._history)
        if m.get("key") not in hist or not isinstance(m.get("skip"), int):
            return "stale"
        target = hist.index(m["key"]) + m["skip"]
        if target == len(hist) - 1:
            return "ours"
        if target > len(hist) - 1:
            return ("it gave this round up and has moved on (rank 0 came after its timeout); it "
                    "joins the next round")  # fmt: skip
        return "stale"

    def _odd_timeout(self, m: Message) -> str | None:
        """Why a plan message of a rank with another timeout fails the round (None: the same):
        it beats every quarter of its own and rank 0 judges it silent after rank 0's (a rank
        with a longer one was given up while it beat as told)."""
        t = m.get("timeout")
        if not isinstance(t, int | float) or isinstance(t, bool) or t == self.timeout:
            return None
        return (f"its FileRendezvous timeout is {t:g}s, rank 0's {self.timeout:g}s: give every "
                "rank the same (each is judged silent after the others' timeout)")  # fmt: skip

    def _plan_record(
        self, rkey: str | None, chained: bool, nonces: dict[str, str], body: Message | None
    ) -> Message:
        """Rank 0's result of a plan round; from here on the next round follows it (whether or
        not the others learn it)."""
        rid = secrets.token_hex(8)
        record: Message = {"group": self._group, "job": self.job, "key": rkey, "id": rid,
                           "nonces": nonces, "body": body}  # fmt: skip
        self._taken.extend(nonces.values())
        if chained:
            record["history"] = list(self._history)
            self._chain = rid
            self._history.append(rid)
        return record

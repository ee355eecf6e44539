"""ReloadingEngine: a host-local checkpoint plus an inference server that reloads it over HTTP.

The shared logic of :class:`~receiver.engines.sglang.SGLang` and
:class:`~receiver.engines.vllm.VLLM`. It composes a
:class:`~receiver.engines.checkpoint.LocalCheckpoint` (patched in place, verified per tensor,
crash safe) and a server that loads weights from that directory. For each version::

    begin/apply        patch the local checkpoint while the server keeps serving
    commit             LocalCheckpoint.commit()  (verify + persist the files)
                       -> pause -> reload(checkpoint, version N) -> resume (always)
                       -> read the server's weight version: must be "N"
    bump (zero diff)   LocalCheckpoint.bump() -> set the server's version label to "N"

``state`` (what the agent acknowledges) is the version the *server* holds: it advances only
after the server confirmed it, and is persisted in ``<checkpoint>/.asyncsync/engine-<kind>.json``
(with the server URL and the path it loads from). When the server fails after the checkpoint
committed N, ``state`` stays at N-1; the agent retries N on its next wake-up, ``begin`` sees
that the checkpoint already holds N (same fingerprint), skips the patching and ``commit``
retries only the reload. Failed server calls back off (``failure_backoff``) so a server that
keeps refusing is not paused once per poll.

``open()`` reconciles: it waits for the server (``Timeouts.startup``), and unless the persisted
record, the checkpoint and the server's reported version all agree, it reloads the checkpoint
into the server once (a restarted server serves whatever it loaded at start, labelled with its
default version). A zero-diff version whose server no longer reports the previous version
(restarted meanwhile) is loaded in full instead of relabelled.

A server that gives no answer to a reload (SGLang's scheduler dies on a checkpoint it cannot
load, and the client sees a dropped connection), or that :meth:`serving_version` (the
receiver's ``/readyz``) finds unreachable or reporting another version than the one held, is
marked *lost*: nothing is acknowledged, and before the next attempt the engine waits for the
server to answer again (``Timeouts.startup``). With no newer version to apply, the agent calls
:meth:`reconcile`, which reloads the checkpoint when the server's label is not the version held.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from asyncsync.errors import ApplyFailed, ConfigError
from asyncsync.format import Manifest
from asyncsync.pipeline import LoopTasks
from receiver.engines.audit_view import AuditWatch
from receiver.engines.backoff import FailureBackoff
from receiver.engines.base import Engine, EngineState, TensorUpdate
from receiver.engines.checkpoint import LocalCheckpoint
from receiver.engines.http_engine import HttpClient, RetryPolicy, Timeouts
from receiver.engines.server_calls import ServerCalls
from receiver.engines.server_lock import ServerLock
from receiver.engines.server_record import read_record, record_of, write_record
from receiver.engines.stage_builder import Staging, clear_stages
from receiver.engines.standing import ServerStanding
from receiver.engines.tied import untied_why
from receiver.state import STATE_DIR_NAME

__all__ = ["ReloadingEngine"]

logger = logging.getLogger(__name__)


@dataclass
class _Txn:
    manifest: Manifest
    reload_only: bool  # the checkpoint already holds the version: only the server is behind
    local_committed: bool = False


class ReloadingEngine(ServerCalls, Engine):
    """Base of the HTTP engines (see the module docstring). Subclasses implement the calls.

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:30000``.
        checkpoint_dir: the host-local checkpoint directory the receiver owns.
        api_key: sent as ``Authorization: Bearer <key>`` on every call.
        admin_api_key: when set, sent instead of ``api_key`` on the calls that change the
            server (the subclass marks them; SGLang's ``--admin-api-key``).
        model_path: the checkpoint directory as the *server* sees it (default: the same
            path; differs when the receiver and the server mount the volume differently).
        timeouts: per-call deadlines; retry: retries of one call (connection errors, 5xx).
        failure_backoff: (first, max) seconds to wait after a failed server update before the
            next attempt; doubles per consecutive failure.
        version_offset: the server is told weight version ``v + version_offset`` for root
            version ``v`` (a trainer that numbers its steps from elsewhere, e.g. slime's
            ``--update-weight-start-version``); the ack still names ``v``.
        in_engine: stage each delta for the server's plugin to apply in place
            (:meth:`_load_stage`), once the server said it can; else every version is a
            reload of the checkpoint.
    """

    def __init__(
        self,
        url: str,
        checkpoint_dir: str | os.PathLike[str],
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        model_path: str | None = None,
        timeouts: Timeouts | None = None,
        retry: RetryPolicy | None = None,
        failure_backoff: tuple[float, float] = (2.0, 60.0),
        version_offset: int = 0,
        in_engine: bool = False,
    ):
        if not isinstance(version_offset, int) or isinstance(version_offset, bool):
            raise ConfigError(f"version_offset must be an int, got {version_offset!r}")
        self.version_offset = version_offset
        if not isinstance(timeouts, Timeouts | None):
            raise ConfigError(f"timeouts must be a Timeouts, got {timeouts!r}")
        if not isinstance(retry, RetryPolicy | None):
            raise ConfigError(f"retry must be a RetryPolicy, got {retry!r}")
        self.timeouts = timeouts or Timeouts()
        self.client = HttpClient(
            url,
            api_key=api_key,
            admin_api_key=admin_api_key,
            retry=retry,
            connect_timeout=self.timeouts.connect,
            name=self.kind,
        )
        self.checkpoint = LocalCheckpoint(checkpoint_dir)
        self.model_path = model_path or str(Path(checkpoint_dir).absolute())
        self.failure_backoff = failure_backoff
        self._backoff = FailureBackoff(failure_backoff, self.kind)
        self.record_path = self.checkpoint.directory / STATE_DIR_NAME / f"engine-{self.kind}.json"
        self.state = EngineState()
        self._txn: _Txn | None = None
        self._opened = False
        self._lock = ServerLock()  # held while open: one receiver per server
        self.standing = ServerStanding(self.client, self.timeouts.silence)
        self._background = LoopTasks()  # a resume a cancelled sync still owes
        self._paused = False  # paused by us and not (known to be) resumed since
        self.in_engine = in_engine
        #: whether the server's plugin takes stages (None: not known until its first answer)
        self.stages_supported: bool | None = None
        self._staging = Staging(self.kind)
        self.audit_watch = AuditWatch(checkpoint_dir)
        self.last_pause_seconds: float | None = None
        #: (monotonic time of the pause request, of the resume's answer), the last reload
        self.last_pause_window: tuple[float, float] | None = None
        self.in_place_applies = 0

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.client.url} checkpoint={self.checkpoint.directory} "
            f"version={self.state.version} checkpoint_version={self.checkpoint.state.version}>"
        )

    def info(self) -> dict[str, Any]:
        """What ``/status`` shows about the server (subclasses add to it)."""
        return {
            "kind": self.kind,
            "url": str(self.client.url),
            **self.standing.info(),
            "in_engine": {
                "enabled": self.in_engine,
                "stages_supported": self.stages_supported,
                "in_place_applies": self.in_place_applies,
                "last_pause_seconds": self.last_pause_seconds,
            },
            "audit": self.audit_watch.summary(),
        }

    def metrics(self) -> dict[str, tuple[str, float | None]]:
        return {
            **self.audit_watch.metrics(),
            "in_place_applies": (
                "Versions the server applied in place from a stage.",
                self.in_place_applies,
            ),
            "last_pause_seconds": (
                "Seconds the server was paused for the last version "
                "(pause to resume, as the receiver saw it).",
                self.last_pause_seconds,
            ),
        }

    def ackable(self) -> EngineState:
        """Nothing while the server is not known to serve the version held: it reports another
        (restarted: :meth:`reconcile`), refuses connections, answered nothing for
        ``Timeouts.silence``, or a failed reload or repair left its weights unknown. The ack
        names nothing until it answers with the version or a reload is confirmed
        (docs/ENGINES.md, "What the agent acknowledges")."""
        return EngineState() if self.standing.withdrawn else self.state

    async def serving_version(self) -> int | None:
        """The version the server serves now (its label: ``state.version``, or that of a reload
        in flight), else None. A mismatch or no answer marks the server lost (the next sync
        reconciles it); what makes the ack go (:meth:`ackable`) withdraws it now (``on_lost``)."""
        held, st = self.state.version, self.standing
        if held is None or st.weights_unknown or st.repair_owed:
            return None
        if st.lost and st.withdrawn and st.loading is None:
            return None  # the sync waits for the server: its probes say when it is back
        mark = self.standing.mark()
        try:  # bounded: the idle check must come back to say a silence out
            async with asyncio.timeout(min(self.timeouts.control, self.timeouts.silence)):
                label = await self._guard(self._served())
        except (ApplyFailed, TimeoutError) as exc:
            logger.info("%s at %s: cannot read its version: %s", self.kind, self.client.url,
                        exc or "no answer")  # fmt: skip
            st.lost |= st.loading is None  # (a reload in flight judges the server itself)
            serving, lost = None, False
        else:
            serving, lost = self.standing.judge(label, held, mark)
        if lost and self.standing.serves_other is None:
            logger.warning("%s at %s reports version %r, the receiver holds v%s: the ack is "
                           "withdrawn and the server reconciled", self.kind, self.client.url,
                           label, held)  # fmt: skip
            self.standing.lost, self.standing.serves_other = True, str(label)
        if self.standing.withdrawn and self.on_lost is not None:
            await self.on_lost()  # (at once: not after the next sync's wait for the server)
        return serving

    async def reconcile(self) -> None:
        """When the server was lost: wait for it, and reload the checkpoint into it unless it
        reports the version held. A no-op otherwise (the agent calls it when it has no newer
        version to apply; a newer version's own reload reconciles the server anyway). Then the
        checkpoint's own (a rollback or a flush that failed: :meth:`LocalCheckpoint.reconcile`)."""
        if self._txn is not None:
            return
        # the checkpoint first: files changed behind its back are wiped here, never reloaded
        await self._on_checkpoint(self.checkpoint.reconcile())
        if self.standing.lost:
            await self._reconcile_server()

    async def _on_checkpoint(self, call: Awaitable[object]) -> None:
        """A call that may wipe the checkpoint (its recovery after a failed flush found the held
        version's bytes lost, a full version's move failed): the engine then holds nothing, as
        a reopen finds. The server serves it from memory only: no restart brings it back and
        no delta applies on it, so the ack goes and the agent goes on from a keyframe."""
        try:
            await call
        finally:
            if self.checkpoint.state.version is None:
                self.state = EngineState()  # (the record: never trusted with no checkpoint)

    async def _reconcile_server(self) -> None:
        await self._wait_for_server()
        label = await self._guard(self._served())
        held, st = self.state.version, self.standing
        owed = st.repair_owed or st.weights_unknown  # the label says nothing of those
        other = label != str(held)
        if held is not None and (owed or other) and self.checkpoint.state.version == held:
            logger.warning("%s at %s reports version %r after it was lost%s; reloading v%s",
                           self.kind, self.client.url, label, f" ({owed})" if owed else "",
                           held)  # fmt: skip
            st.serves_other = str(label) if other else st.serves_other
            if self.on_lost is not None:  # the agent withdraws the ack first
                await self.on_lost()
            self._backoff.check(held)
            await self._reload_server(held, full=st.repair_owed is not None)
        st.lost = False
        st.serves_other = None  # (answered with the version held: the ack comes back)

    async def repair(self) -> None:
        """Reload the held version into the server in full (after a failed audit); its files
        checked first (changed behind the receiver's back: wiped, never reloaded)."""
        held = self.state.version
        await self._on_checkpoint(self.checkpoint.reconcile())
        if held is not None and self.checkpoint.state.version is None:
            if self.on_lost is not None:  # the engine holds nothing now: no ack
                await self.on_lost()
            raise ApplyFailed(
                f"{self.kind}: cannot repair v{held}: the checkpoint's files were changed behind "
                "the receiver's back and were removed; the receiver re-initialises them from a "
                "keyframe"
            )
        if held is None or self.checkpoint.state.version != held:
            raise ApplyFailed(
                f"{self.kind}: cannot repair: the checkpoint holds "
                f"v{self.checkpoint.state.version}, the server should serve v{held}"
            )
        logger.warning("%s at %s: reloading v%s in full", self.kind, self.client.url, held)
        self._backoff.reset()  # an audit's repair is not a retried update
        self.standing.repair_owed = f"an audit found other bytes served than v{held}"
        if self.on_lost is not None:  # not served as the ack says: withdrawn until repaired
            await self.on_lost()
        try:
            await self._reload_server(held, full=True)
        except BaseException:
            self.standing.lost = True  # the next sync with nothing newer repairs it again
            raise

    # -- Engine contract ---------------------------------------------------------------------
    def _no_redo_log(self) -> None:
        """Refuse a checkpoint that keeps deltas beside its files (``redo_log``): the server
        reloads from the files, which would hold an older version than the label it is given
        (set on ``self.checkpoint`` after the constructor, or a checkpoint put in its place)."""
        if n := self.checkpoint.redo_log:
            raise ConfigError(
                f"{self.kind}: the checkpoint {self.checkpoint.directory} has redo_log={n}: the "
                "server reloads from the checkpoint's files, which must hold every version "
                "acknowledged, and a redo log keeps deltas beside them; use a LocalCheckpoint "
                "without redo_log"
            )

    async def open(self) -> EngineState:
        if self._opened:
            return self.state
        self._no_redo_log()
        lock = await ServerLock.take_in_thread(self.kind, self.client.url, self.model_path)
        try:
            local = await self.checkpoint.open()
            record = await asyncio.to_thread(read_record, self.record_path)
            await self.client.wait_until_up(
                self.ready_path,
                deadline=self.timeouts.startup,
                call_timeout=self.timeouts.control,
            )
            await self._check_server()
            # after the checks: a server still applying a stage sent by a receiver killed while
            # it waited for the answer reads it to the end (SGLang's _check_server waits for it)
            await asyncio.to_thread(clear_stages, self.checkpoint.directory)
            label = await self._served()
            if local.version is None:
                self.state = EngineState()  # nothing to serve yet: the agent seeds the checkpoint
            elif record == self._record_of(local) and label == str(local.version):
                self.state = local
            else:
                logger.warning("%s at %s reports version %r, the checkpoint holds v%s (record: "
                               "%s): reloading the checkpoint into the server", self.kind,
                               self.client.url, label, local.version, "matches" if record ==
                               self._record_of(local) else "differs or missing")  # fmt: skip
                with self.standing.changing(local.version):
                    await self._reload_server(local.version)
                    await self._set_state(local)
        except BaseException:
            try:
                await self.client.close()
                await self.checkpoint.close()
            finally:
                lock.release()
            raise
        self._opened, self._lock = True, lock
        logger.info("%s at %s: serving version %s", self.kind, self.client.url, self.state.version)
        return self.state

    async def close(self) -> None:
        """Close the client and the checkpoint and release the server; the server lock is
        released on every path (an error or a cancellation earlier in ``close`` included: a
        reused Ray actor, a library caller, would keep the server from a replacement)."""
        try:
            if self._txn is not None:
                await self.abort()
            # a resume still running: waited for, cancelled past its deadline (it must not
            # outlive close()); one of another event loop is forgotten (LoopTasks), made here
            if await self._background.finish(self.timeouts.control):
                logger.warning("%s: a resume call was still running at close: cancelled",
                               self.kind)  # fmt: skip
            elif self._paused and self._opened:
                try:
                    await self._resumed()
                except Exception as exc:
                    logger.warning("%s: resuming at close failed: %s", self.kind, exc)
        finally:
            try:
                await self.client.close()
                await self.checkpoint.close()
            finally:
                self._opened = False
                self._lock.release()

    async def begin(self, manifest: Manifest, mode: Literal["delta", "full"]) -> None:
        if self._txn is not None:
            raise ApplyFailed(
                f"{self.kind}: begin v{manifest.version} while v{self._txn.manifest.version} "
                "is in progress; commit or abort it first"
            )
        self._no_redo_log()
        self._backoff.check(manifest.version)
        untied = await asyncio.to_thread(untied_why, self.checkpoint.directory, manifest)
        if untied is not None:  # the server would serve another lm_head than the version's
            raise ApplyFailed(f"{self.kind}: {untied}")
        if self.in_engine and await self.audit_watch.check(self.state) is not None:
            self.standing.lost = True  # not staged onto it: this version's reload repairs it
        if await self._still_holds(manifest):
            logger.info("%s: the checkpoint already holds v%s; only reloading the server",
                        self.kind, manifest.version)  # fmt: skip
            self._txn = _Txn(manifest, reload_only=True)
            return
        local = self.checkpoint.state
        await self._on_checkpoint(self.checkpoint.begin(manifest, mode))
        self._txn = _Txn(manifest, reload_only=False)
        if mode == "delta" and self._may_stage(local):
            await self._staging.begin(self.checkpoint, manifest, self.state)

    def _may_stage(self, local: EngineState) -> bool:
        """Stage the version for an in-place apply: the server takes stages, holds exactly what
        the checkpoint holds, and nothing needs reconciling."""
        return (
            self.in_engine
            and self.stages_supported is True
            and not self.standing.lost
            and self.standing.weights_unknown is None
            and self.audit_watch.problem is None
            and self.state.version is not None
            and self.state == local
        )

    async def apply(self, updates: list[TensorUpdate]) -> None:
        txn = self._need_txn()
        if not txn.reload_only:
            await self._staging.add(updates)  # first: a set patch's XOR needs the old bytes
            await self.checkpoint.apply(updates)

    async def commit(self) -> str:
        txn = self._need_txn()
        m = txn.manifest
        # stage first: the plugin verifies it while the checkpoint commits (applied only below)
        stage = await self._staging.commit()
        if not txn.reload_only:
            try:
                await self._on_checkpoint(self.checkpoint.commit())  # a full one may wipe it
            except BaseException:
                await self._staging.drop()
                raise
            txn.local_committed = True
        self._txn = None
        with self.standing.changing(m.version):  # until the engine holds it (serving_version)
            try:
                await self._reload_server(m.version, stage=stage)
            finally:
                await self._staging.drop()
            await self._set_state(self.checkpoint.state)
        return m.fingerprint

    async def abort(self) -> None:
        await self._staging.drop()
        txn, self._txn = self._txn, None
        if txn is None or not (txn.reload_only or txn.local_committed):  # None: a begin cancelled
            await self.checkpoint.abort()  # while the checkpoint's ran on in its thread (or none)

    async def acknowledged(self) -> None:
        await self.checkpoint.acknowledged()

    async def bump(self, manifest: Manifest) -> None:
        if self._txn is not None:
            raise ApplyFailed(f"{self.kind}: bump while v{self._txn.manifest.version} is open")
        self._no_redo_log()
        self._backoff.check(manifest.version)
        if not await self._still_holds(manifest):
            await self._on_checkpoint(self.checkpoint.bump(manifest))
        if self.standing.lost:
            await self._wait_for_server()
        label = await self._guard(self._served())
        with self.standing.changing(manifest.version):
            if self.state.version is not None and label == str(self.state.version):
                try:
                    await self._guard(self._relabel(manifest.version + self.version_offset))
                    await self._confirm(manifest.version)
                except ApplyFailed:
                    self._backoff.failed()
                    raise
            else:
                logger.warning("%s reports version %r, expected %s: loading v%s in full "
                               "instead of relabelling", self.kind, label, self.state.version,
                               manifest.version)  # fmt: skip
                await self._reload_server(manifest.version)
            await self._set_state(self.checkpoint.state)

    # -- bookkeeping -------------------------------------------------------------------------
    def _need_txn(self) -> _Txn:
        if self._txn is None:
            raise ApplyFailed(f"{self.kind}: apply/commit without begin")
        return self._txn

    async def _still_holds(self, m: Manifest) -> bool:
        """Whether the checkpoint holds ``m`` (the server alone behind), its files checked
        first: changed behind the receiver's back, they are wiped, never reloaded."""
        if not self._holds(self.checkpoint.state, m):
            return False
        await self._on_checkpoint(self.checkpoint.reconcile())
        return self._holds(self.checkpoint.state, m)

    @staticmethod
    def _holds(local: EngineState, m: Manifest) -> bool:
        held = (local.version, local.run_id, local.fingerprint)
        return held == (m.version, m.run_id, m.fingerprint)

    def _record_of(self, s: EngineState) -> dict[str, Any]:
        return record_of(self.kind, str(self.client.url), self.model_path, s)

    async def _set_state(self, s: EngineState) -> None:
        await asyncio.to_thread(write_record, self.record_path, self._record_of(s))
        self.state = s

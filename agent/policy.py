"""Policy: findings in, decisions and a node verdict out.

The engine does no I/O and never reads a clock: every call takes `now`, so the same findings, config and times
always give the same decisions. It updates the `PolicyState` it is handed (the state store persists it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterable

from pydantic import BaseModel, ConfigDict, Field

from nodemedic.catalog import Catalog, CatalogEntry
from nodemedic.model import DEEP_ERROR, DEEP_IN_PROGRESS, Action, FaultDetail, Finding, Health, NodeVerdict

VERDICT_FAULTS = 20
HISTORY_LIMIT = 200


class CheckMode(str, enum.Enum):
    ENFORCE = "enforce"
    OBSERVE = "observe"  # evaluated and logged, never changes the verdict (a per-check dry run)


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dedup_window_s: float = Field(default=600, ge=0, description="repeats of an active fault within this are one incident")
    repeat_window_s: float = Field(default=86400, ge=0, description="a fault that comes back within this escalates")
    post_reboot_window_s: float = Field(default=7 * 86400, ge=0, description="a fault back after a reboot escalates")
    clear_on_reboot: bool = Field(default=True, description="a reboot remedies reboot- and reset-level faults")
    check_modes: dict[str, CheckMode] = Field(default_factory=dict)


class Outcome(str, enum.Enum):
    ACTIVATED = "activated"          # a new fault counts against the node
    ESCALATED = "escalated"          # it came back after a remedy: one step harsher
    RAISED = "raised"                # an active fault's source now names a harsher remedy
    REPEATED = "repeated"            # an active fault still occurring, reported once per dedup window
    NO_ACTION = "no_action"          # an application error or a fault whose action is none: logged only
    CORROBORATED = "corroborated"    # a second source confirmed a held fault: its remedy now applies
    BELOW_THRESHOLD = "below_threshold"
    CLEARED = "cleared"              # a healthy finding or an operator cleared it
    REMEDIED = "remedied"            # the reboot it asked for happened

    def __str__(self) -> str:
        return self.value


class ActiveFault(BaseModel):
    model_config = ConfigDict(extra="ignore")

    code: str
    component: str
    check: str
    type: str
    message: str
    action: Action
    first_seen: float
    last_seen: float
    count: int = 1
    reported_at: float = 0.0
    enforced: bool = True
    escalated_from: Action | None = None
    evidence: dict[str, Any] = {}
    sources: list[str] = []                 # independent sources that reported it (nvml, nvidia_smi, pci, ...)
    held_action: Action | None = None       # the remedy waiting for a second source to corroborate it


class Incident(BaseModel):
    model_config = ConfigDict(extra="ignore")

    started: float
    ended: float | None = None
    ended_by: str | None = None  # "healthy", "operator", "reboot"


class DeepCheckRun(BaseModel):
    """A deep-check run in progress: the node is held while it lasts, and no longer than its lease."""

    model_config = ConfigDict(extra="ignore")

    run_id: str
    started: float
    expires: float          # a runner that died mid-run must not hold the node forever
    hold: bool = True
    level: int = 2
    trigger: str = ""


class PolicyState(BaseModel):
    """Everything the policy remembers; persisted whole by the state store."""

    model_config = ConfigDict(extra="ignore")

    version: int = 1
    active: dict[str, ActiveFault] = {}
    sightings: dict[str, list[float]] = {}      # below-threshold sightings per key, pruned to the window
    noted: dict[str, float] = {}                # no-action faults: last time each was logged, for dedup
    incidents: dict[str, list[Incident]] = {}   # per key, pruned to the escalation windows
    history: list[FaultDetail] = []             # newest last, capped
    boot_id: str | None = None
    verdict: NodeVerdict = NodeVerdict()
    suppressed: int = 0                         # repeats folded into an active fault
    deep_run: DeepCheckRun | None = None        # the deep-check run now holding the node


@dataclass(slots=True)
class Decision:
    """One thing the policy decided; each becomes one detection-event log line."""

    outcome: Outcome
    code: str
    component: str
    action: Action
    health_before: Health
    health_after: Health
    reason: str
    check: str = ""
    type: str = ""
    enforced: bool = True
    count: int = 1
    finding: Finding | None = None
    at: float = 0.0
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def verdict_changed(self) -> bool:
        return self.health_before != self.health_after


def fault_key(code: str, component: str) -> str:
    return f"{code}|{component}"


def source_of(check: str) -> str:
    """Checks named `<source>.<part>` (nvml.events, nvml.fields) are one source when corroborating."""
    return check.partition(".")[0]


class Policy:
    def __init__(self, catalog: Catalog, config: PolicyConfig | None = None):
        self.catalog = catalog
        self.config = config or PolicyConfig()

    # -- findings ----------------------------------------------------------------------------------------------
    def observe(self, state: PolicyState, finding: Finding, now: float) -> Decision | None:
        """Fold one finding into the state; return the decision it caused, or None for a repeat or a no-op."""
        if finding.healthy:
            return self._healthy(state, finding, now)

        entry = self.catalog.get(finding.code)
        key = fault_key(finding.code, finding.component)
        action = self._action_for(entry, finding)
        active = state.active.get(key)

        if action <= Action.NONE:
            return self._no_action(state, entry, key, finding, now)
        if active is not None:
            active.count += finding.repeats
            active.last_seen = max(active.last_seen, now)
            before = state.verdict.health
            source = source_of(finding.check)
            if source not in active.sources:
                active.sources.append(source)
                if active.held_action is not None and len(active.sources) >= 2:
                    state.suppressed += finding.repeats - 1
                    active.action, active.held_action = max(active.held_action, action), None
                    active.reported_at = now
                    self._record(state, active, now)
                    self._refresh(state, now)
                    return self._decision(Outcome.CORROBORATED, entry, active, before, state, finding, now,
                                          f"{entry.title or finding.code}: confirmed by "
                                          f"{' and '.join(active.sources)}")
            if active.held_action is not None:
                active.held_action = max(active.held_action, action)
                action = Action.WATCH
            if action > active.action:
                state.suppressed += finding.repeats - 1
                # The source now names a harsher remedy (Xid 154 moving from reset to reboot, say).
                active.action = action
                active.message = finding.message
                active.evidence = finding.evidence
                active.reported_at = now
                self._record(state, active, now)
                self._refresh(state, now)
                return self._decision(Outcome.RAISED, entry, active, before, state, finding, now,
                                      f"{entry.title or finding.code}: remedy raised to {action}")
            if now - active.reported_at < self._dedup(entry):
                # A fault stays active until it is cleared, so its repeats are one incident, never a second.
                state.suppressed += finding.repeats
                return None
            state.suppressed += finding.repeats - 1
            active.reported_at = now
            return self._decision(Outcome.REPEATED, entry, active, before, state, finding, now,
                                  f"{entry.title or finding.code}: still occurring ({active.count} times)")

        if entry.threshold_count > 1:
            seen = state.sightings.setdefault(key, [])
            horizon = now - entry.threshold_window_s
            while seen and seen[0] < horizon:
                seen.pop(0)
            earlier = len(seen)
            seen.extend([now] * min(finding.repeats, entry.threshold_count))
            if len(seen) < entry.threshold_count:
                if earlier:
                    state.suppressed += finding.repeats
                    return None
                state.suppressed += finding.repeats - 1
                health = state.verdict.health
                return Decision(Outcome.BELOW_THRESHOLD, finding.code, finding.component, Action.NONE, health,
                                health, f"{entry.title or finding.code}: seen {len(seen)} of "
                                f"{entry.threshold_count} times in {entry.threshold_window_s:g}s",
                                check=finding.check, type=entry.type, enforced=self._enforced(finding),
                                count=len(seen), finding=finding, at=now, evidence=finding.evidence)
            del state.sightings[key]

        escalated_from, why = self._escalation(state, entry, key, action, now)
        if escalated_from is not None:
            action = action.escalated()
            action = min(action, entry.max_action)
        incidents = state.incidents.setdefault(key, [])
        incidents.append(Incident(started=now))
        before = state.verdict.health
        state.suppressed += finding.repeats - 1
        held = None
        if entry.corroborate and action > Action.WATCH:
            # Never trust one signal for a destructive action: watch until an independent source agrees.
            held, action = action, Action.WATCH
        fault = ActiveFault(code=finding.code, component=finding.component, check=finding.check, type=entry.type,
                            message=finding.message, action=action, first_seen=now, last_seen=now, reported_at=now,
                            count=finding.repeats,
                            enforced=self._enforced(finding), escalated_from=escalated_from,
                            evidence=finding.evidence, sources=[source_of(finding.check)], held_action=held)
        state.active[key] = fault
        self._record(state, fault, now)
        self._refresh(state, now)
        if escalated_from is not None:
            return self._decision(Outcome.ESCALATED, entry, fault, before, state, finding, now,
                                  f"{entry.title or finding.code}: {why}; {escalated_from} -> {action}")
        reason = entry.title or finding.code
        if entry.action > entry.max_action:
            reason += f" ({entry.kind.value} fault: never takes the node out of service)"
        if held is not None:
            reason += f" (held at watch until a second source confirms it; wants {held})"
        return self._decision(Outcome.ACTIVATED, entry, fault, before, state, finding, now, reason)

    def observe_all(self, state: PolicyState, findings: Iterable[Finding], now: float) -> list[Decision]:
        return [d for f in findings if (d := self.observe(state, f, now)) is not None]

    # -- other inputs --------------------------------------------------------------------------------------------
    def on_boot(self, state: PolicyState, boot_id: str, now: float) -> list[Decision]:
        """A new boot remedies the reboot- and reset-level faults it was taken for; replace-level faults stay."""
        previous, state.boot_id = state.boot_id, boot_id
        if previous is None or previous == boot_id or not self.config.clear_on_reboot:
            return []
        done = [k for k, f in state.active.items() if Action.RESET_GPU <= f.action <= Action.REBOOT]
        return self._clear(state, done, now, Outcome.REMEDIED, "reboot", "node rebooted")

    def operator_clear(self, state: PolicyState, now: float, *, code: str | None = None,
                       component: str | None = None) -> list[Decision]:
        """An operator's explicit recovery: clears matching active faults (all, if nothing is named)."""
        keys = [k for k, f in state.active.items()
                if (code is None or f.code == code) and (component is None or f.component == component)]
        for k in keys:
            state.sightings.pop(k, None)
        return self._clear(state, keys, now, Outcome.CLEARED, "operator", "cleared by operator")

    def deep_check_begin(self, state: PolicyState, run: DeepCheckRun, now: float) -> None:
        """Publish `InProgress` and (with `run.hold`) hold the node out of scheduling until the run ends."""
        state.deep_run = run
        self._refresh(state, now, deep_check=DEEP_IN_PROGRESS)

    def deep_check_end(self, state: PolicyState, run_id: str, status: str, now: float) -> bool:
        """Publish the run's outcome and lift its hold; False when `run_id` is not the run in progress."""
        if state.deep_run is None or state.deep_run.run_id != run_id:
            return False
        state.deep_run = None
        self._refresh(state, now, deep_check=status)
        return True

    def deep_check_expire(self, state: PolicyState, now: float) -> bool:
        """A run whose lease ran out (its runner died) ends as `Error`, so the hold is lifted."""
        if state.deep_run is None or now < state.deep_run.expires:
            return False
        return self.deep_check_end(state, state.deep_run.run_id, DEEP_ERROR, now)

    # -- internals -----------------------------------------------------------------------------------------------
    def _dedup(self, entry: CatalogEntry) -> float:
        return entry.dedup_window_s if entry.dedup_window_s is not None else self.config.dedup_window_s

    def _no_action(self, state: PolicyState, entry: CatalogEntry, key: str, finding: Finding,
                   now: float) -> Decision | None:
        """Application errors are logged once per dedup window and never held against the node."""
        window = self._dedup(entry)
        last = state.noted.get(key)
        if last is not None and now - last < window:
            state.suppressed += finding.repeats
            return None
        state.suppressed += finding.repeats - 1
        state.noted[key] = now
        if len(state.noted) > 256:
            state.noted = {k: t for k, t in state.noted.items() if now - t < window}
        health = state.verdict.health
        return Decision(Outcome.NO_ACTION, finding.code, finding.component, Action.NONE, health, health,
                        f"{entry.title or finding.code} ({entry.kind.value} error: no node action)",
                        check=finding.check, type=entry.type, enforced=self._enforced(finding), finding=finding,
                        at=now, evidence=finding.evidence)

    def _healthy(self, state: PolicyState, finding: Finding, now: float) -> Decision | None:
        key = fault_key(finding.code, finding.component)
        state.sightings.pop(key, None)
        active = state.active.get(key)
        if active is None:
            return None
        source = source_of(finding.check)
        if source in active.sources:
            active.sources.remove(source)
        if active.sources:
            return None  # another source still reports it: one source's all-clear does not outvote it
        decisions = self._clear(state, [key], now, Outcome.CLEARED, "healthy", finding.message, finding)
        return decisions[0]

    def _clear(self, state: PolicyState, keys: list[str], now: float, outcome: Outcome, ended_by: str,
               reason: str, finding: Finding | None = None) -> list[Decision]:
        decisions = []
        for key in keys:
            before = state.verdict.health
            fault = state.active.pop(key)
            for inc in state.incidents.get(key, []):
                if inc.ended is None:
                    inc.ended, inc.ended_by = now, ended_by
            self._refresh(state, now)
            entry = self.catalog.get(fault.code)
            decisions.append(self._decision(outcome, entry, fault, before, state, finding, now,
                                            f"{entry.title or fault.code}: {reason}", action=Action.NONE))
        return decisions

    def _action_for(self, entry: CatalogEntry, finding: Finding) -> Action:
        action = entry.action
        if entry.named_action and finding.recommended_action is not None:
            action = finding.recommended_action
        return min(action, entry.max_action)

    def _enforced(self, finding: Finding) -> bool:
        modes = self.config.check_modes
        mode = modes.get(finding.check) or modes.get(source_of(finding.check), CheckMode.ENFORCE)
        return mode is CheckMode.ENFORCE

    def _escalation(self, state: PolicyState, entry: CatalogEntry, key: str, action: Action,
                    now: float) -> tuple[Action | None, str]:
        incidents = state.incidents.get(key)
        if not incidents:
            return None, ""
        keep = max(self.config.repeat_window_s, self.config.post_reboot_window_s)
        incidents[:] = [i for i in incidents if (i.ended or now) >= now - keep]
        if not entry.escalate or action < Action.RESET_GPU or action >= entry.max_action:
            return None, ""
        for inc in reversed(incidents):
            if inc.ended_by == "reboot" and inc.ended is not None and now - inc.ended <= self.config.post_reboot_window_s:
                return action, "came back after a reboot"
        for inc in reversed(incidents):
            if now - inc.started <= self.config.repeat_window_s:
                return action, f"second incident within {self.config.repeat_window_s:g}s"
        return None, ""

    def _record(self, state: PolicyState, fault: ActiveFault, now: float) -> None:
        state.history.append(self._detail(fault, now))
        if len(state.history) > HISTORY_LIMIT:
            del state.history[: len(state.history) - HISTORY_LIMIT]

    @staticmethod
    def _detail(fault: ActiveFault, at: float) -> FaultDetail:
        return FaultDetail(time=at, component=fault.component, code=fault.code, type=fault.type,
                           message=fault.message, action=str(fault.action), check=fault.check, count=fault.count,
                           enforced=fault.enforced)

    def _refresh(self, state: PolicyState, now: float, deep_check: str | None = None) -> None:
        enforced = [f for f in state.active.values() if f.enforced]
        action = max((f.action for f in enforced), default=Action.NONE)
        newest = sorted(enforced, key=lambda f: f.last_seen, reverse=True)
        # Types and reasons explain why the node is out of service; watch-level faults only show in the details.
        serious = [f for f in newest if f.action >= Action.RESET_GPU]
        v = state.verdict
        health = Health.for_action(action)
        if health is Health.SCHEDULABLE and state.deep_run is not None and state.deep_run.hold:
            health = Health.UNSCHEDULABLE  # held for the deep checks, not for a fault
        new = NodeVerdict(
            health=health,
            action=str(action),
            fault_types=sorted({f.type for f in serious}),
            fault_reasons=sorted({f.code for f in serious}),
            faults=[self._detail(f, f.last_seen) for f in newest[:VERDICT_FAULTS]],
            deep_check=deep_check or v.deep_check,
            generation=v.generation,
            updated_at=now,
        )
        if (new.health, new.fault_reasons, new.fault_types, new.deep_check) != \
                (v.health, v.fault_reasons, v.fault_types, v.deep_check):
            new.generation = v.generation + 1
        state.verdict = new

    def _decision(self, outcome: Outcome, entry: CatalogEntry, fault: ActiveFault, before: Health,
                  state: PolicyState, finding: Finding | None, now: float, reason: str,
                  action: Action | None = None) -> Decision:
        return Decision(outcome, fault.code, fault.component, fault.action if action is None else action, before,
                        state.verdict.health, reason, check=fault.check, type=entry.type, enforced=fault.enforced,
                        count=fault.count, finding=finding, at=now,
                        evidence=finding.evidence if finding is not None else {})

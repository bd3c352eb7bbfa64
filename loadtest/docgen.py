"""Helpers of the benchmarks that write docs: where the figures come from (the code, the
machine, a running server's /metrics), and the generated block of a doc, replaced without
touching the prose around it."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import urllib.request
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def metric(url: str, name: str) -> float:
    """One metric family summed over its label sets; KeyError when the server lacks it
    (a missing gauge must not read as zero blocks in use)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{") or line.startswith(name + " ")]
    if not values:
        raise KeyError(f"{name} is not in {url}/metrics")
    return sum(values)


def commit() -> str:
    """The checked-out commit, with "+changes" when the tree differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown commit"
    return f"{head}+changes" if dirty else head or "unknown commit"


def cpu() -> str:
    """The CPU model and the cores this process may use, e.g. "AMD EPYC 9R14, 2 cores"."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name", "unknown CPU")
    if "cpu family" in fields:      # virtual machines often report a bare vendor name
        name += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}, {cores} cores"


def machine(device: str = "cpu") -> str:
    """The CPU, and the GPU when `device` is one."""
    if device.startswith("cuda"):
        try:
            import torch
            return f"{torch.cuda.get_device_name(0)}, host {cpu()}"
        except Exception:
            return f"a CUDA GPU, host {cpu()}"
    return cpu()


def write_block(path: Path, name: str, lines: list[str]) -> None:
    """Put `lines` between `<!-- name:start -->` and `<!-- name:end -->` in `path` (appended
    with its markers when absent); everything outside the markers is left as it is."""
    block = "\n".join(lines) + "\n"
    text = path.read_text() if path.exists() else ""
    start, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->\n"
    if start in text and end in text:
        text = text[:text.index(start) + len(start)] + block + text[text.index(end):]
    else:
        text += ("\n" if text and not text.endswith("\n") else "") + start + block + end
    path.write_text(text)


@contextmanager
def trees(baseline: str | None):
    """The code a benchmark runs in turn: [(the checkout, commit())], and with `baseline`
    also (a temporary git worktree of that revision, baseline), removed on leaving."""
    if not baseline:
        yield [(REPO, commit())]
        return
    path = Path(tempfile.mkdtemp(prefix="bench-baseline-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(path),
                    baseline], check=True)
    try:
        yield [(REPO, commit()), (path, baseline)]
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
                       check=False)
        shutil.rmtree(path.parent, ignore_errors=True)


def in_turn(items: list, round_no: int) -> list:
    """`items` in order in even rounds, reversed in odd ones: drift in the machine's speed
    weighs on each alike."""
    return items if round_no % 2 == 0 else items[::-1]

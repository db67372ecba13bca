"""The Dockerfile: hadolint-clean, shaped as documented, and its install steps really produce a
working, torch-free pdproxy (run in a fresh venv: no Docker engine runs here)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from urllib.parse import urlparse

import helm_python as helm
import pytest

from pdproxy import __version__
from pdproxy.compiled import COMPILED_MODULES
from pdproxy.config import Settings
from pdproxy.demo.processes import LOOPBACK, ManagedProcess, free_ports, wait_http_ok
from tests.deploy.support import CHART, REPO, Stage, key_values, read_dockerfile

DOCKERFILE = REPO / "Dockerfile"
HADOLINT = Path(sysconfig.get_path("scripts")) / "hadolint"
GLOBAL_ARGS, STAGES = read_dockerfile(DOCKERFILE)
BUILD = next(s for s in STAGES if s.name == "build")
RUNTIME = STAGES[-1]


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HADOLINT), "--no-color", "--format", "tty", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_hadolint_is_clean() -> None:
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


def test_hadolint_really_lints(tmp_path: Path) -> None:
    """The check above can fail: hadolint flags an unpinned apt install and a root user."""
    bad = tmp_path / "Dockerfile"
    bad.write_text(
        "FROM python:3.11-slim\nRUN apt-get update && apt-get install -y curl\n"
        "USER root\nCMD python -m http.server\n",
        encoding="utf-8",
    )
    result = hadolint(bad)
    assert result.returncode != 0
    for rule in ("DL3008", "DL3015", "DL3002", "DL3025"):
        assert rule in result.stdout


# ---- shape -------------------------------------------------------------------------------------


def test_two_stages_on_python_311_slim_at_run_time() -> None:
    assert [s.name for s in STAGES] == ["build", "runtime"]
    runtime = re.fullmatch(r"python:3\.11-slim(-(\w+))?", GLOBAL_ARGS["PYTHON_IMAGE"])
    assert runtime is not None
    # The build stage compiles: the full image of the same Python and Debian release.
    assert GLOBAL_ARGS["BUILD_IMAGE"] == f"python:3.11{'-' + runtime[2] if runtime[2] else ''}"
    assert [s.base for s in STAGES] == ["${BUILD_IMAGE}", "${PYTHON_IMAGE}"]
    # The runtime stage installs nothing: it only takes the built venv.
    assert [i.text for i in RUNTIME.get("COPY")] == ["--from=build /opt/pdproxy /opt/pdproxy"]
    assert not any("pip" in i.text for i in RUNTIME.get("RUN"))


def test_runs_as_an_unprivileged_user() -> None:
    (user,) = RUNTIME.get("USER")
    uid, _, gid = user.text.partition(":")
    assert uid.isdigit() and int(uid) >= 1000 and gid.isdigit()
    (adduser,) = RUNTIME.get("RUN")
    assert f"--uid {uid}" in adduser.text and f"--gid {gid}" in adduser.text


def test_entrypoint_ports_and_healthcheck() -> None:
    (entrypoint,) = RUNTIME.get("ENTRYPOINT")
    assert entrypoint.exec_form() == ["pdproxy", "serve"]
    (expose,) = RUNTIME.get("EXPOSE")
    defaults = Settings()
    registry_port = defaults.registry_bind.rsplit(":", 1)[1]
    assert expose.text.split() == [str(defaults.port), registry_port] == ["8000", "30001"]
    (healthcheck,) = RUNTIME.get("HEALTHCHECK")
    command = healthcheck.exec_form()
    assert command[:2] == ["python", "-c"] and "/health" in command[2]
    assert "curl" not in healthcheck.text and "wget" not in healthcheck.text


def test_oci_labels_and_versions() -> None:
    (label,) = RUNTIME.get("LABEL")
    labels = key_values(label.text)
    for key in ("title", "description", "version", "revision", "created", "licenses"):
        assert labels.get(f"org.opencontainers.image.{key}"), key
    args = {i.text.partition("=")[0]: i.text.partition("=")[2] for i in RUNTIME.get("ARG")}
    assert labels["org.opencontainers.image.version"] == "${VERSION}"
    with helm.Chart.load(CHART) as chart:
        app_version = chart.metadata["appVersion"]
    assert args["VERSION"] == __version__ == app_version


# ---- the build context -------------------------------------------------------------------------


def dockerignore_patterns() -> list[tuple[bool, str]]:
    patterns = []
    for raw in (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            negated = line.startswith("!")
            patterns.append((negated, line.lstrip("!").rstrip("/")))
    return patterns


def _matches(pattern: str, path: str) -> bool:
    """Docker's matching: a pattern matches a path or any of its parent directories."""
    regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*")
    regex = regex.replace(r"\?", "[^/]")
    parts = path.split("/")
    return any(re.fullmatch(regex, "/".join(parts[: i + 1])) for i in range(len(parts)))


def in_context(path: str) -> bool:
    """Whether the build context holds `path` (relative to the repo): the last match wins."""
    included = True
    for negated, pattern in dockerignore_patterns():
        if _matches(pattern, path):
            included = negated
    return included


def test_dockerignore_keeps_only_the_package() -> None:
    for kept in (
        "pyproject.toml",
        "README.md",
        "setup.py",
        "pdproxy/cli.py",
        "pdproxy/proxy/app.py",
    ):
        assert in_context(kept), kept
    for dropped in (
        ".git/config",
        ".venv/bin/python",
        "tests/conftest.py",
        "helm/pdproxy/Chart.yaml",
        "deploy/docker-compose.yaml",
        "pdproxy/__pycache__/cli.cpython-311.pyc",
        "pdproxy.egg-info/PKG-INFO",
        "Dockerfile",
    ):
        assert not in_context(dropped), dropped


def copy_context(stage: Stage, workdir: Path) -> None:
    """Carry out the stage's COPY lines from the build context (the repo less .dockerignore)."""
    for instruction in stage.get("COPY"):
        *sources, destination = instruction.text.split()
        assert not any(s.startswith("--") for s in sources), instruction.text
        target = workdir / destination
        for source in sources:
            origin = REPO / source
            files = [origin] if origin.is_file() else sorted(origin.rglob("*"))
            for path in files:
                relative = path.relative_to(REPO).as_posix()
                if not path.is_file() or not in_context(relative):
                    continue
                if origin.is_file():
                    dest = target / path.name if destination.endswith("/") else target
                else:
                    dest = target / path.relative_to(origin)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, dest)


# ---- the install steps, for real ---------------------------------------------------------------


# The image's extras whose packages a machine's local mirrors may lack: fetched once, before
# the offline install, into a folder the install then reads like a local mirror.
IMAGE_EXTRA_REQUIREMENTS = (
    "kubernetes_asyncio>=32",
    "opentelemetry-sdk>=1.25",
    "opentelemetry-exporter-otlp-proto-http>=1.25",
)
WHEELHOUSE = Path.home() / ".cache" / "pdproxy" / "image-wheels"


def image_wheelhouse() -> Path:
    """The set-up step: the extras' wheels, downloaded with the machine's own pip settings
    (network allowed) unless a previous run left them."""
    stamp = WHEELHOUSE / ".complete"
    wanted = "\n".join(IMAGE_EXTRA_REQUIREMENTS)
    if not stamp.exists() or stamp.read_text() != wanted:
        WHEELHOUSE.mkdir(parents=True, exist_ok=True)
        fetched = subprocess.run(
            [
                *(sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:"),
                *("--dest", str(WHEELHOUSE), *IMAGE_EXTRA_REQUIREMENTS),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert fetched.returncode == 0, f"fetching the image's extras failed:\n{fetched.stderr}"
        stamp.write_text(wanted)
    return WHEELHOUSE


def local_package_sources() -> dict[str, str]:
    """pip settings that keep every install on this machine's own package mirrors.

    The install reaches no network beyond loopback; pip is pointed at the file:// indexes and
    find-links folders of the machine's pip configuration (plus the wheelhouse of
    `image_wheelhouse`, filled beforehand), and any attempt to go further is sent to a dead
    loopback proxy so that it fails at once.
    """
    result = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    config: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        config.setdefault(name, []).extend(value.strip().strip("'\"").split())
    for name in ("index-url", "extra-index-url", "find-links"):
        from_env = os.environ.get(f"PIP_{name.upper().replace('-', '_')}")
        if from_env:
            config.setdefault(name, []).extend(from_env.split())

    def local(url: str) -> bool:
        return urlparse(url).scheme in ("file", "") and Path(urlparse(url).path).exists()

    indexes = [
        u for u in config.get("index-url", []) + config.get("extra-index-url", []) if local(u)
    ]
    links = [u for u in config.get("find-links", []) if local(u)] + [str(image_wheelhouse())]
    assert indexes or links, (
        "this machine's pip configuration names no local package index or find-links folder; "
        "the install test runs offline and needs one"
    )
    dead = f"http://{LOOPBACK}:9"
    env = {
        "PIP_FIND_LINKS": " ".join(links),
        "PIP_RETRIES": "0",
        "PIP_CONFIG_FILE": os.devnull,
        "HTTP_PROXY": dead,
        "HTTPS_PROXY": dead,
        "http_proxy": dead,
        "https_proxy": dead,
        "NO_PROXY": "",
    }
    if indexes:
        env["PIP_INDEX_URL"] = indexes[0]
        env["PIP_EXTRA_INDEX_URL"] = " ".join(indexes[1:])
    else:
        env["PIP_NO_INDEX"] = "1"
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The build stage carried out in a temporary root: WORKDIR, COPY, ENV and RUN, with the
    image's /opt/pdproxy venv mapped to a fresh directory. Returns that venv."""
    root = tmp_path_factory.mktemp("image")
    (venv_path,) = {i.text.split()[-1] for i in RUNTIME.get("COPY")}
    (workdir,) = (i.text for i in BUILD.get("WORKDIR"))
    mapping = {venv_path: str(root / "venv"), workdir: str(root / "src")}
    shims = root / "shims"  # `python` in the build stage is the base image's Python 3.11
    shims.mkdir()
    (shims / "python").symlink_to(sys.executable)
    (root / "src").mkdir()
    copy_context(BUILD, root / "src")
    env = {"PATH": f"{shims}:/usr/bin:/bin", "HOME": str(root), **local_package_sources()}
    for instruction in BUILD.get("ENV"):
        env.update(key_values(instruction.text))
    runs = [i.text for i in BUILD.get("RUN")]
    assert any("pip install" in r for r in runs), runs
    for run in runs:
        command = run
        for image_path, local_path in mapping.items():
            command = command.replace(image_path, local_path)
        step = subprocess.run(
            ["/bin/sh", "-c", command],
            cwd=root / "src",
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
            check=False,
        )
        assert step.returncode == 0, f"RUN {command}\n{step.stdout}\n{step.stderr}"
    return root / "venv"


@pytest.mark.timeout(600)
def test_installed_pdproxy_is_compiled_and_runs_without_torch(installed: Path) -> None:
    python = installed / "bin" / "python"
    assert installed.joinpath("bin", "pdproxy").exists()
    help_text = subprocess.run(
        [str(installed / "bin" / "pdproxy"), "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "--registry-bind" in help_text and "--upstream-api-key" in help_text
    version = subprocess.run(
        [str(installed / "bin" / "pdproxy"), "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    count = len(COMPILED_MODULES)
    assert f"compiled with mypyc: {count} of {count} hot-path modules" in version, version
    probe = (
        "import importlib.util as u, importlib.metadata as m, json, pdproxy; "
        "print(json.dumps([u.find_spec('torch') is None, pdproxy.__file__, "
        "sorted(d.metadata['Name'].lower() for d in m.distributions())]))"
    )
    out = subprocess.run(  # cwd: not the repository, whose pdproxy/ `python -c` would import
        [str(python), "-c", probe],
        cwd=installed,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    no_torch, location, names = json.loads(out.stdout)
    dists = {re.sub(r"[-_.]+", "-", name) for name in names}  # PEP 503 normalised
    assert no_torch, "torch is importable in the image's venv"
    assert location.startswith(str(installed)), "pdproxy was not imported from the fresh venv"
    assert not [d for d in dists if d == "torch" or d.startswith(("nvidia-", "triton"))]
    assert "mypy" not in dists, "the compiler's venv leaked into the image's"
    for required in (
        "pdproxy",
        "fastapi",
        "uvicorn",
        "pyzmq",
        "aiohttp",
        "prometheus-client",
        "kubernetes-asyncio",
        "opentelemetry-sdk",
        "opentelemetry-exporter-otlp-proto-http",
    ):
        assert required in dists


@pytest.mark.timeout(600)
def test_entrypoint_and_healthcheck_of_the_installed_image(installed: Path, tmp_path: Path) -> None:
    """ENTRYPOINT + CMD from the fresh venv serve; the HEALTHCHECK command passes against it
    and fails once it is gone."""
    (entrypoint,) = RUNTIME.get("ENTRYPOINT")
    (cmd,) = RUNTIME.get("CMD")
    argv = entrypoint.exec_form() + cmd.exec_form()
    (healthcheck,) = RUNTIME.get("HEALTHCHECK")
    check = healthcheck.exec_form()
    path_env = f"{installed / 'bin'}:/usr/bin:/bin"
    port, registry = free_ports(2)
    env = {
        "PATH": path_env,
        "PDPROXY_HOST": LOOPBACK,
        "PDPROXY_PORT": str(port),
        "PDPROXY_REGISTRY_BIND": f"tcp://{LOOPBACK}:{registry}",
    }
    health_env = {"PATH": path_env, "PDPROXY_PORT": str(port)}

    def healthcheck_passes() -> bool:
        done = subprocess.run(check, env=health_env, capture_output=True, timeout=30, check=False)
        return done.returncode == 0

    assert not healthcheck_passes()  # nothing listens yet
    proxy = ManagedProcess(
        "image", [str(installed / "bin" / argv[0]), *argv[1:]], tmp_path / "log", env
    )
    try:
        proxy.start()
        wait_http_ok(f"http://{LOOPBACK}:{port}/health", 30.0, [proxy])
        assert healthcheck_passes()
    finally:
        proxy.stop()
    assert not healthcheck_passes()

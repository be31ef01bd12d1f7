"""scripts/setup.sh's Redis step on machines unlike this one: no root, sudo with or without a
password, no apt. Run with a PATH of stand-ins (``id``, ``sudo``, ``apt-get``) and no
``redis-server``, in a copy of the repository whose venv is already set up, so the script
stops right after that step."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The real tools the step and the fingerprint use.
TOOLS = ("bash", "cat", "cut", "dirname", "env", "sha256sum")


def _stand_in(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)


def _run(tmp_path: Path, uid: int, sudo: str | None, apt: bool) -> tuple[str, list[str]]:
    repo, bin_ = tmp_path / "repo", tmp_path / "bin"
    (repo / "scripts").mkdir(parents=True)
    bin_.mkdir()
    for name in ("pyproject.toml", "scripts/setup.sh"):
        shutil.copy(ROOT / name, repo / name)
    # A venv set up for exactly these files: the script exits after the Redis step.
    (repo / ".venv").mkdir()
    digest = hashlib.sha256(
        b"".join((repo / n).read_bytes() for n in ("pyproject.toml", "scripts/setup.sh"))
    )
    (repo / ".venv" / ".kvturn-setup-done").write_text(digest.hexdigest() + "\n")
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, tool
        (bin_ / tool).symlink_to(found)
    calls = tmp_path / "calls"
    _stand_in(bin_ / "id", f"[[ $1 == -u ]] && echo {uid}")
    if sudo == "passwordless":
        _stand_in(bin_ / "sudo", f'echo "sudo $*" >> {calls}; [[ $1 == -n ]] && shift; "$@"')
    elif sudo == "password":
        _stand_in(bin_ / "sudo", "echo 'sudo: a password is required' >&2; exit 1")
    if apt:
        _stand_in(bin_ / "apt-get", f'echo "apt-get $*" >> {calls}')
    result = subprocess.run(
        ["bash", str(repo / "scripts" / "setup.sh")],
        env={"PATH": str(bin_), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    recorded = calls.read_text().splitlines() if calls.exists() else []
    return result.stdout + result.stderr, recorded


@pytest.mark.parametrize("sudo", [None, "password"])
def test_without_root_it_names_the_command_to_run_instead(tmp_path: Path, sudo: str | None) -> None:
    output, calls = _run(tmp_path, uid=1000, sudo=sudo, apt=True)
    assert calls == []
    assert "needs root" in output
    assert "KVTURN_SKIP_REDIS_TESTS=1 make test" in output


def test_with_passwordless_sudo_it_installs_through_sudo(tmp_path: Path) -> None:
    output, calls = _run(tmp_path, uid=1000, sudo="passwordless", apt=True)
    assert "installing redis-server" in output
    assert calls[-2:] == [
        "sudo -n env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server",
        "apt-get install -y -q redis-server",
    ]


def test_as_root_it_installs_with_apt(tmp_path: Path) -> None:
    _, calls = _run(tmp_path, uid=0, sudo=None, apt=True)
    assert calls == ["apt-get install -y -q redis-server"]


def test_without_apt_it_says_to_use_the_systems_package_manager(tmp_path: Path) -> None:
    output, calls = _run(tmp_path, uid=0, sudo=None, apt=False)
    assert calls == [] and "no apt-get" in output
    assert "KVTURN_SKIP_REDIS_TESTS=1 make test" in output


def test_the_redis_tests_skip_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.gateway_fixtures import RedisServer

    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("KVTURN_SKIP_REDIS_TESTS", raising=False)
    with pytest.raises(pytest.fail.Exception, match="KVTURN_SKIP_REDIS_TESTS=1"):
        RedisServer(0).start()
    monkeypatch.setenv("KVTURN_SKIP_REDIS_TESTS", "1")
    with pytest.raises(pytest.skip.Exception):
        RedisServer(0).start()

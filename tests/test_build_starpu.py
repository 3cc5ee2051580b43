"""tools/build-starpu.sh's download: the release's sha256 is checked before anything reads the
file, and a failed or wrong download leaves nothing under the tarball's name. No network: the
address is pointed at local files (SL_STARPU_URL, file://), which curl reads like a server."""
import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "build-starpu.sh"


def run(*args, url, cwd):
    env = dict(os.environ, SL_STARPU_URL=url, SL_SKIP_DEPS="1")
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def curl():
    """The script downloads with curl when it is there (wget cannot read file:// addresses);
    tools/install-system-deps.sh installs it."""
    assert subprocess.run(["sh", "-c", "command -v curl"]).returncode == 0, "no curl: make system"


def test_a_download_whose_checksum_differs_is_removed(curl, tmp_path):
    fake = tmp_path / "starpu-1.4.12.tar.gz"
    fake.write_bytes(b"not the release" * 100)
    out = tmp_path / "deps" / "starpu-1.4.12.tar.gz"
    r = run("--fetch", str(out), url=fake.as_uri(), cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert "sha256" in r.stderr and "a186e0f4" in r.stderr and "nothing unpacked" in r.stderr
    assert not out.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == []  # no .part or .check left


def test_a_download_that_fails_says_what_to_do(curl, tmp_path):
    out = tmp_path / "starpu-1.4.12.tar.gz"
    r = run("--fetch", str(out), url=(tmp_path / "absent.tar.gz").as_uri(), cwd=tmp_path)
    assert r.returncode == 1
    assert "could not download" in r.stderr and "connected machine" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_file_already_downloaded_is_checked_again(curl, tmp_path):
    # the file at the tarball's place (an interrupted or replaced download) is not trusted
    out = tmp_path / "starpu-1.4.12.tar.gz"
    out.write_bytes(b"tampered")
    r = run("--fetch", str(out), url=(tmp_path / "absent.tar.gz").as_uri(), cwd=tmp_path)
    assert r.returncode == 1 and "expected a186e0f4" in r.stderr
    assert not out.exists()


def test_a_missing_tarball_path_names_the_download(tmp_path):
    r = run(str(tmp_path / "nope.tar.gz"), str(tmp_path / "prefix"), url="file:///dev/null",
            cwd=tmp_path)
    assert r.returncode == 1
    assert "no tarball at" in r.stderr and "'download'" in r.stderr
    assert not (tmp_path / "prefix").exists()

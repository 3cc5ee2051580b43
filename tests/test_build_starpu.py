"""tools/build-starpu.sh's download: the release's sha256 is checked before anything reads the
file, and a failed or wrong download leaves nothing under the tarball's name. No network: the
address is pointed at local files (SL_STARPU_URL, file://), which curl reads like a server."""
import os
import subprocess
import sys
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


# The commands tools/install-system-deps.sh looks for where dpkg-query is absent (the packages of
# build-starpu.sh's list: libtool-bin is libtool and libtoolize, libopenmpi-dev mpicc, openmpi-bin
# mpirun), and what would install packages.
BUILD_COMMANDS = ("autoconf", "automake", "libtool", "libtoolize", "make", "gcc", "patch", "mpicc",
                  "mpirun")
DEBIAN_ONLY = ("dpkg-query", "dpkg", "apt-get", "sudo", "pkg-config")


def machine_without_dpkg(tmp_path, have, hwloc):
    """A PATH of this machine's commands without dpkg-query, apt-get or sudo (another
    distribution, a cluster's login node): of the build's commands only those in `have`, as
    stand-ins, and a pkg-config that knows hwloc when hwloc."""
    bin = tmp_path / "bin"
    bin.mkdir()
    for d in ("/usr/bin", "/bin"):
        for name in os.listdir(d):
            if name not in BUILD_COMMANDS + DEBIAN_ONLY and not os.path.lexists(bin / name):
                os.symlink(os.path.join(d, name), bin / name)
    for name in have:
        (bin / name).write_text("#!/bin/sh\nexit 0\n")
    (bin / "pkg-config").write_text(
        f'#!/bin/sh\n[ "$1" = --exists ] && [ "$2" = hwloc ] && {"true" if hwloc else "false"}\n')
    for f in bin.iterdir():
        if not f.is_symlink():
            f.chmod(0o755)
    return dict(os.environ, PATH=str(bin), PYTHON=sys.executable)


def test_without_dpkg_the_commands_the_build_uses_pass_the_check(tmp_path):
    env = machine_without_dpkg(tmp_path, BUILD_COMMANDS, hwloc=True)
    r = subprocess.run(["bash", str(SCRIPT.parent / "install-system-deps.sh"), "autoconf",
                        "automake", "libtool-bin", "make", "gcc", "patch", "pkg-config",
                        "libhwloc-dev", "libopenmpi-dev", "openmpi-bin"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == r.stderr == ""          # nothing installed, nothing to say


def test_without_dpkg_a_missing_command_is_named_with_what_to_do(tmp_path):
    # build-starpu.sh on a cluster without libtoolize and hwloc.pc: named, with the modules to
    # load and SL_SKIP_DEPS; no sudo, no apt-get
    env = machine_without_dpkg(tmp_path, [c for c in BUILD_COMMANDS if c != "libtoolize"],
                               hwloc=False)
    tarball = tmp_path / "starpu-1.4.12.tar.gz"
    tarball.write_bytes(b"never unpacked")
    r = subprocess.run(["bash", str(SCRIPT), str(tarball), str(tmp_path / "prefix")], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "libtool-bin (the commands libtool and libtoolize)" in r.stderr, r.stderr
    assert "libhwloc-dev (pkg-config's hwloc.pc)" in r.stderr
    assert "autoconf" not in r.stderr.split("missing system packages:")[1].split(".")[0]
    assert "module load" in r.stderr and "SL_SKIP_DEPS=1" in r.stderr
    assert "installing" not in r.stdout + r.stderr


def fake_cuda_tree(tmp_path):
    """A CUDA home (nvcc, cublas_v2.h, libcublas.so.13 as stand-ins) and a StarPU tarball whose
    tree records the fixes and whose configure prints the options it was given and fails."""
    cuda = tmp_path / "cuda"
    for d in ("bin", "include", "lib64"):
        (cuda / d).mkdir(parents=True)
    (cuda / "bin" / "nvcc").write_text("#!/bin/sh\nexit 0\n")
    (cuda / "bin" / "nvcc").chmod(0o755)
    (cuda / "include" / "cublas_v2.h").write_text("")
    (cuda / "lib64" / "libcublas.so.13").write_text("")
    tree = tmp_path / "src" / "starpu-1.4.12"
    tree.mkdir(parents=True)
    fixes = sorted((SCRIPT.parent / "patches").glob("starpu-1.4.12-*.patch"))
    (tree / ".starpu-llm-fixes").write_text("".join(
        f"{f.name} {subprocess.run(['sha256sum', str(f)], capture_output=True, text=True).stdout.split()[0]}\n"
        for f in fixes))
    (tree / "configure").write_text('#!/bin/sh\necho "CONFIGURE: $*"\nexit 1\n')
    (tree / "configure").chmod(0o755)
    tarball = tmp_path / "starpu-1.4.12.tar.gz"
    subprocess.run(["tar", "-czf", str(tarball), "-C", str(tree.parent), tree.name], check=True)
    return cuda, tarball


@pytest.mark.parametrize("mpicc", [True, False])
def test_a_gpu_node_without_mpicc_builds_starpu_without_mpi(tmp_path, mpicc):
    # the device machine (SL_SKIP_DEPS, nothing installed): without an MPI compiler configure
    # would stop at --enable-mpi and nothing of the GPU run would follow
    cuda, tarball = fake_cuda_tree(tmp_path)
    env = machine_without_dpkg(tmp_path, [c for c in BUILD_COMMANDS if mpicc or c != "mpicc"],
                               hwloc=True)
    env.update(CUDA_HOME=str(cuda), SL_SKIP_DEPS="1")
    r = subprocess.run(["bash", str(SCRIPT), "--cuda", str(tarball), str(tmp_path / "prefix")],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "CONFIGURE: " in r.stderr, r.stderr   # reached configure
    options = r.stderr.split("CONFIGURE: ", 1)[1].split("\n", 1)[0].split()
    assert ("--enable-mpi" in options) == mpicc and ("--disable-mpi" in options) != mpicc
    assert ("built without StarPU-MPI" in r.stderr) != mpicc

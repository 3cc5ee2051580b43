#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages given, or by default those starpu-llm builds against,
# when any is missing: StarPU (+MPI), Open MPI, hwloc, pkg-config and OpenBLAS (its OpenMP
# build, used by default), and curl (the server's tests). SL_NO_APT=1: install nothing, fail
# naming what is missing.
#
# A machine without dpkg (another distribution, a cluster whose tools come from modules) is
# checked for what the build uses of each package instead: its commands (autoconf, libtoolize,
# gcc, mpicc...) on PATH and its pkg-config modules (hwloc.pc...); nothing is installed there.
# Without root, what modules or other means already provide counts as there too, and apt-get
# runs through sudo only where sudo works (without a password, or asking at a terminal).
set -euo pipefail
if [ $# -gt 0 ]; then
  pkgs=("$@")
else
  pkgs=(libstarpu-dev libstarpumpi-1.3-3 starpu-tools libopenmpi-dev openmpi-bin libhwloc-dev
        pkg-config libopenblas-dev libopenblas-openmp-dev gcc g++ make python3-venv curl)
fi

# What the build uses of package $1, for a machine whose packages dpkg does not list: a word on
# what it is (for the message) in $what, and whether it is found (the status).
commands() { local c; for c in "$@"; do command -v "$c" >/dev/null || return 1; done; }
pc() { command -v pkg-config >/dev/null && pkg-config --exists "$@" 2>/dev/null; }
py() { "${PYTHON:-python3}" -c "$1" 2>/dev/null; }
provides() {
  case $1 in
    libtool-bin|libtool) what="the commands libtool and libtoolize"; commands libtool libtoolize ;;
    libhwloc-dev) what="pkg-config's hwloc.pc"; pc hwloc ;;
    libopenmpi-dev) what="the MPI compiler wrapper mpicc"; commands mpicc ;;
    openmpi-bin) what="mpirun"; commands mpirun ;;
    libstarpu-dev) what="pkg-config's starpu-1.4.pc or starpu-1.3.pc"; pc starpu-1.4 || pc starpu-1.3 ;;
    libstarpumpi-*) what="pkg-config's starpumpi-1.4.pc or starpumpi-1.3.pc"
                    pc starpumpi-1.4 || pc starpumpi-1.3 ;;
    starpu-tools) what="StarPU's tools, e.g. starpu_machine_display"; commands starpu_machine_display ;;
    libopenblas-dev|libopenblas-openmp-dev) what="pkg-config's openblas.pc"; pc openblas ;;
    python3-dev) what="Python.h of ${PYTHON:-python3}"
                 py 'import os, sysconfig; assert os.path.exists(sysconfig.get_paths()["include"] + "/Python.h")' ;;
    python3-setuptools) what="setuptools in ${PYTHON:-python3}"; py 'import setuptools' ;;
    python3-venv) what="venv and ensurepip in ${PYTHON:-python3}"; py 'import venv, ensurepip' ;;
    *) what="the command $1"; commands "$1" ;;
  esac
}
# "PKG (what it is)" for each package given
described() { local p; for p in "$@"; do provides "$p" || true; echo "$p ($what)"; done; }
fail() {
  local list; list=$(described "$@" | paste -sd, - | sed 's/,/, /g')
  echo "missing system packages: $list. Load your site's modules for them (e.g. module load" \
       "autoconf automake libtool hwloc openmpi; a module's lib/pkgconfig on PKG_CONFIG_PATH" \
       "for its .pc) or install them by other means${why_not_apt:+ ($why_not_apt)}" >&2
  exit 1
}

missing=()
if command -v dpkg-query >/dev/null; then
  for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
else
  for p in "${pkgs[@]}"; do provides "$p" || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && exit 0
  why_not_apt="no dpkg here: nothing is installed"
  fail "${missing[@]}"
fi
# A StarPU found by pkg-config (e.g. a cluster module through PKG_CONFIG_PATH) replaces Debian's.
if [ $# -eq 0 ] && pc starpu-1.4; then
  missing=($(printf '%s\n' "${missing[@]}" | grep -v -e '^libstarpu' -e '^starpu-tools' || true))
fi
[ ${#missing[@]} -eq 0 ] && exit 0
if [ -n "${SL_NO_APT:-}" ] || ! command -v apt-get >/dev/null; then
  why_not_apt=$([ -n "${SL_NO_APT:-}" ] && echo "SL_NO_APT is set" || echo "no apt-get here")
  fail "${missing[@]}"
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  # without root: what modules or other means provide is enough
  left=()
  for p in "${missing[@]}"; do provides "$p" || left+=("$p"); done
  [ ${#left[@]} -eq 0 ] && exit 0
  missing=("${left[@]}")
  if ! command -v sudo >/dev/null || { ! sudo -n true 2>/dev/null && ! [ -t 0 ]; }; then
    why_not_apt="not root, and no sudo that works without a password here"
    fail "${missing[@]}"
  fi
  SUDO="sudo"
  echo "installing system packages with sudo apt-get (not root; SL_NO_APT=1: install nothing," \
       "name what is missing): ${missing[*]}"
else
  echo "installing system packages: ${missing[*]}"
fi
why_not_apt="apt-get failed"
$SUDO apt-get update -qq || fail "${missing[@]}"
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null ||
  fail "${missing[@]}"

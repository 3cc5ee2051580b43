#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages given, or by default those starpu-llm builds against,
# when any is missing: StarPU (+MPI), Open MPI, hwloc, pkg-config and OpenBLAS (its OpenMP
# build, used by default), and curl (the server's tests). SL_NO_APT=1: install nothing, fail
# naming what is missing.
set -euo pipefail
if [ $# -gt 0 ]; then
  pkgs=("$@")
else
  pkgs=(libstarpu-dev libstarpumpi-1.3-3 starpu-tools libopenmpi-dev openmpi-bin libhwloc-dev
        pkg-config libopenblas-dev libopenblas-openmp-dev gcc g++ make python3-venv curl)
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
# A StarPU found by pkg-config (e.g. a cluster module through PKG_CONFIG_PATH) replaces Debian's.
if [ $# -eq 0 ] && pkg-config --exists starpu-1.4 2>/dev/null; then
  missing=($(printf '%s\n' "${missing[@]}" | grep -v -e '^libstarpu' -e '^starpu-tools' || true))
fi
[ ${#missing[@]} -eq 0 ] && exit 0
if [ -n "${SL_NO_APT:-}" ] || ! command -v apt-get >/dev/null; then
  echo "missing system packages: ${missing[*]} (install them by other means, e.g. your site's modules)" >&2
  exit 1
fi
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "installing system packages: ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null

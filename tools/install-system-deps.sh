#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages starpu-llm builds against, if any is missing:
# StarPU (+MPI), Open MPI, hwloc, pkg-config and OpenBLAS (its OpenMP build, used by default).
set -euo pipefail
pkgs=(libstarpu-dev libstarpumpi-1.3-3 starpu-tools libopenmpi-dev openmpi-bin libhwloc-dev
      pkg-config libopenblas-dev libopenblas-openmp-dev gcc make python3-venv)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
# A StarPU found by pkg-config (e.g. a cluster module through PKG_CONFIG_PATH) replaces Debian's.
if pkg-config --exists starpu-1.4 2>/dev/null; then
  missing=($(printf '%s\n' "${missing[@]}" | grep -v -e '^libstarpu' -e '^starpu-tools' || true))
fi
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null; then
  echo "missing system packages: ${missing[*]} (no apt-get here: install StarPU, OpenBLAS and MPI by other means)" >&2
  exit 1
fi
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "installing system packages: ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null

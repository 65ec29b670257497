#!/usr/bin/env bash
# Install Debian's Slurm daemons and munge for the `slurm` tests (tests/slurm_cluster.py starts them); idempotent.
#   bash .ci/install_slurm.sh
set -euo pipefail

packages=(slurmctld slurmd slurm-client munge)
missing=()
for package in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "install_slurm: ${packages[*]} already installed"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install_slurm: missing ${missing[*]}; run as root (apt-get), or the slurm tests will be skipped" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
# The package lists may be absent or stale on a fresh machine: refresh once, then install.
apt-get update -qq
# policy-rc.d 101: the packages' postinst must not try to start services (no systemd/init here; the tests start them).
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && created_policy=1
fi
trap 'if [ "$created_policy" -eq 1 ]; then rm -f "$policy"; fi' EXIT
apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install_slurm: installed ${missing[*]}"

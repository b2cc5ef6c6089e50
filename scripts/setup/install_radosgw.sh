#!/usr/bin/env bash
# Install Ceph radosgw + a monitor + an OSD (what scripts/setup/radosgw.sh needs), if they are missing.
#
# Idempotent: does nothing when radosgw, ceph-mon, ceph-osd, radosgw-admin, ceph and monmaptool
# (all that scripts/setup/radosgw.sh runs) are on PATH.
# Otherwise installs the Debian/Ubuntu packages with apt-get (root only). Exits 0 when the tools
# are there afterwards; otherwise exits non-zero with a one-line reason on stderr.
set -uo pipefail

TOOLS=(radosgw ceph-mon ceph-osd radosgw-admin ceph monmaptool)
PACKAGES=(radosgw ceph-mon ceph-osd ceph-common)

missing() {
    local t out=()
    for t in "${TOOLS[@]}"; do
        command -v "$t" >/dev/null 2>&1 || out+=("$t")
    done
    echo "${out[*]}"
}

need=$(missing)
[ -z "$need" ] && exit 0

fail() { echo "install_radosgw.sh: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || fail "cannot install ceph (missing: $need): not root"
command -v apt-get >/dev/null 2>&1 || fail "cannot install ceph (missing: $need): no apt-get"

log=$(mktemp -t install_radosgw.XXXXXX.log)
export DEBIAN_FRONTEND=noninteractive
# The packages' maintainer scripts may try to start services; we want none (the tests start their
# own daemons): a policy-rc.d answering 101 tells invoke-rc.d not to start anything.
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && trap 'rm -f "$policy"' EXIT
fi
install() {
    apt-get install -y -q --no-install-recommends \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
        "${PACKAGES[@]}" >>"$log" 2>&1
}
# Refresh the package lists first only when apt does not know the packages (saves ~10 s), and
# again if the install fails (stale lists name versions the mirror no longer has).
if ! apt-cache show radosgw >/dev/null 2>&1; then
    apt-get update -q >>"$log" 2>&1 || fail "apt-get update failed (log: $log): $(tail -n 1 "$log")"
fi
if ! install; then
    apt-get update -q >>"$log" 2>&1 || fail "apt-get update failed (log: $log): $(tail -n 1 "$log")"
    install || fail "apt-get install ${PACKAGES[*]} failed (log: $log): $(tail -n 1 "$log")"
fi

need=$(missing)
[ -z "$need" ] || fail "installed ${PACKAGES[*]} but still missing: $need (log: $log)"
rm -f "$log"
exit 0

#!/usr/bin/env bash
# Installs the system programs the deploy tests run for real: nginx, prometheus (with promtool)
# and docker-compose (only its `config` is used: no Docker daemon needed). Installs with apt-get
# when one is missing and we are root or `sudo -n` works; otherwise says what is missing and
# carries on (the tests that need it skip). Never fails the caller.
set -uo pipefail

# program → Debian package
declare -A PACKAGE=([nginx]=nginx [prometheus]=prometheus [promtool]=prometheus [docker-compose]=docker-compose)

missing_packages() {
  local prog out=()
  for prog in "${!PACKAGE[@]}"; do
    # nginx lives in /usr/sbin, which a non-root PATH may lack
    command -v "$prog" >/dev/null 2>&1 || [ -x "/usr/sbin/$prog" ] || out+=("${PACKAGE[$prog]}")
  done
  printf '%s\n' "${out[@]}" | sort -u | grep -v '^$'
}

mapfile -t missing < <(missing_packages)
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -eq 0 ]; then SUDO=(); elif sudo -n true 2>/dev/null; then SUDO=(sudo -n); else
  echo "system-deps: missing ${missing[*]} (not root, no sudo): the tests that need them skip" >&2
  exit 0
fi

echo "system-deps: installing ${missing[*]}" >&2
# Keep the packages' maintainer scripts from starting the services (a stray nginx on :80, a
# Prometheus on :9090): policy-rc.d answering 101 forbids it, and is removed again afterwards.
POLICY=/usr/sbin/policy-rc.d
own_policy=0
if [ ! -e "$POLICY" ]; then
  printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee "$POLICY" >/dev/null && "${SUDO[@]}" chmod +x "$POLICY" && own_policy=1
fi
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -q >/dev/null 2>&1 || echo "system-deps: apt-get update failed" >&2
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
  || echo "system-deps: apt-get install ${missing[*]} failed: the tests that need them skip" >&2
[ $own_policy -eq 1 ] && "${SUDO[@]}" rm -f "$POLICY"

mapfile -t still < <(missing_packages)
[ ${#still[@]} -eq 0 ] || echo "system-deps: still missing ${still[*]}" >&2
exit 0

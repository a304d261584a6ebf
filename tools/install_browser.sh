#!/bin/sh
# Installs the browser the cookbook's page tests drive: Debian's chromium and chromium-driver (apt).
# Idempotent: does nothing when both are on PATH. selenium, the Python side, is a pinned test dependency.
set -eu

if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO=sudo
fi
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver
chromium --version

#!/usr/bin/env bash
# Make a local Debian base image with python3 for building deploy/Containerfile where no
# image registry is reachable: debootstrap a minimal root filesystem, import it into
# buildah's (vfs) storage as localhost/phasescope-base:<suite>-<version>, print its name.
#
# The root filesystem tarball is cached under $PHASESCOPE_CACHE (default
# ~/.cache/phasescope-ci), keyed by suite and BASE_VERSION, so a second run takes seconds.
# The host's CA bundle is copied in (and PIP_CERT set) so pip inside the build trusts
# the same certificate authorities as the host. Needs root, debootstrap and buildah.
set -euo pipefail
SUITE=${SUITE:-bookworm}
BASE_VERSION=${BASE_VERSION:-1}   # bump to rebuild the cached base
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE=${PHASESCOPE_CACHE:-$HOME/.cache/phasescope-ci}
IMAGE=localhost/phasescope-base:$SUITE-$BASE_VERSION
B=(buildah --storage-driver vfs)

if "${B[@]}" inspect --type image "$IMAGE" >/dev/null 2>&1; then
    echo "$IMAGE"; exit 0
fi
mkdir -p "$CACHE"
TAR=$CACHE/base-$SUITE-$BASE_VERSION.tar
if [ ! -s "$TAR" ]; then
    ROOT=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    trap 'rm -rf "$ROOT"' EXIT
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        "$SUITE" "$ROOT" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 || { tail -20 "$CACHE/debootstrap.log" >&2; exit 1; }
    rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/* "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/*
    tar -C "$ROOT" -cf "$TAR.tmp" . && mv "$TAR.tmp" "$TAR"
fi
CTR=$("${B[@]}" from scratch)
"${B[@]}" add "$CTR" "$TAR" / >&2
if [ -s /etc/ssl/certs/ca-certificates.crt ]; then
    "${B[@]}" copy "$CTR" /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt >&2
fi
"${B[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    --cmd /bin/bash "$CTR" >&2
"${B[@]}" commit --rm "$CTR" "$IMAGE" >&2
echo "$IMAGE"

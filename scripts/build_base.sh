#!/bin/sh
# A container base image from the Debian archive alone, for hosts that reach no container
# registry (`make docker-base`, docs/container.md): Debian bookworm with its python3 (+ venv),
# make, git and CA certificates, made by mmdebstrap and imported into the engine.
#   scripts/build_base.sh ENGINE IMAGE MIRROR
# SOURCE_DATE_EPOCH fixes the times mmdebstrap writes, so the same packages give the same
# root filesystem; its sha256 (the image's one layer) is printed and kept as a label, since the
# archive moves on (security updates) and the tag alone would not say which packages it holds.
set -eu
engine=$1 image=$2 mirror=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1700000000} mmdebstrap --quiet --variant=apt \
  --include=python3,python3-venv,ca-certificates,make,git bookworm "$tmp/rootfs.tar" "$mirror"
sha=$(sha256sum "$tmp/rootfs.tar" | cut -d' ' -f1)
"$engine" import --change 'CMD ["/bin/sh"]' --change "LABEL org.reprotrain.rootfs.sha256=$sha" \
  "$tmp/rootfs.tar" "$image" >/dev/null
echo "built $image from $mirror (root filesystem sha256 $sha); build on it:" \
  "make docker-build BASE_REF=$image"

#!/bin/sh
# The one place the image's pip flags live (the Dockerfile's builders and tests/test_container.py
# run this file): every file comes from a hashed lock, no resolver, wheels only.
#   pip-lock.sh download DIR LOCK...       each file the locks name for this Python, from the
#                                          package registry, hash-checked, into DIR
#   pip-lock.sh install DIR LOCK... [-- PIP_OPTION...]
#                                          into $VENV (default /opt/venv) from DIR alone
#                                          (--no-index: no network at all), hash-checked again
# --no-build-isolation: the one sdist (SDIST_ONLY, pure Python) builds with the venv's own
# setuptools; build isolation would fetch an unhashed setuptools from the index.
set -eu
mode=$1 dir=$2
shift 2
venv=${VENV:-/opt/venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check --no-input "$@"; }
# A CA bundle given as the build secret ca_bundle (a TLS-inspecting proxy's): pip trusts it.
if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi
flags="--require-hashes --no-deps --only-binary :all: --no-binary ${SDIST_ONLY:?} --no-build-isolation"
locks=""
while [ $# -gt 0 ] && [ "$1" != "--" ]; do locks="$locks $1"; shift; done
[ $# -gt 0 ] && shift  # what follows -- goes to pip install
case $mode in
  # one lock at a time: a package pinned in two locks is one file in DIR, hash-checked twice
  download) for lock in $locks; do pip download $flags --dest "$dir" -r "$lock"; done ;;
  install) pip install $flags --no-index --find-links "$dir" $(printf -- ' -r %s' $locks) "$@" ;;
  *) echo "error: pip-lock.sh download|install DIR LOCK... [-- PIP_OPTION...]" >&2; exit 2 ;;
esac

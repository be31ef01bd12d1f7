#!/usr/bin/env bash
# Build deploy/Dockerfile's gateway image with buildah (daemonless, from Debian's packages) and
# run it: `kvturn --help` (the image's entrypoint with --help) and its default command
# (`kvturn serve --help`), as the image's own user. Then the image is removed.
#
# The base: $KVTURN_IMAGE_BASE when set (e.g. python:3.11-slim, where a container registry can
# be reached); else Debian 12 with python3 made here from Debian's own packages (mmdebstrap,
# with this machine's apt sources), imported as localhost/kvturn-base:bookworm and kept in
# buildah's storage for the next run: this project's machines reach no container registry.
# That base also carries this machine's CA bundle, with a pip.conf that points pip at it (the
# machine reaches PyPI through a TLS proxy); nothing else of this machine's pip configuration
# (no local wheel folder, no mirror): the image's packages come from PyPI.
#
# Needs root (buildah's storage, mmdebstrap), or buildah and mmdebstrap already installed and
# a rootless setup of your own; without either it says so and skips.
set -euo pipefail
cd "$(dirname "$0")/.."

# vfs: works without overlayfs support in the kernel (this project's machines are sandboxes).
export STORAGE_DRIVER=${STORAGE_DRIVER:-vfs}
base=${KVTURN_IMAGE_BASE:-localhost/kvturn-base:bookworm}
image=localhost/kvturn:image-check
work=$(mktemp -d)
ctr=""
cleanup() {
  rm -rf "$work"
  if [[ -n $ctr ]]; then
    buildah rm "$ctr" >/dev/null 2>&1 || true
    buildah rmi "$image" >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

if ! command -v buildah >/dev/null 2>&1 || { [[ -z ${KVTURN_IMAGE_BASE:-} ]] &&
  ! command -v mmdebstrap >/dev/null 2>&1; }; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "image-check: installing buildah and mmdebstrap (Debian packages)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      buildah mmdebstrap >/dev/null ||
      { apt-get update -q >/dev/null &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
          buildah mmdebstrap >/dev/null; }
  else
    echo "image-check: SKIPPED: needs buildah and mmdebstrap (as root: apt-get install buildah" \
      "mmdebstrap)"
    exit 0
  fi
fi

if [[ -z ${KVTURN_IMAGE_BASE:-} ]] && ! buildah inspect --type image "$base" >/dev/null 2>&1; then
  echo "image-check: making $base from Debian's packages (once)"
  sources=$(ls /etc/apt/sources.list.d/debian.sources 2>/dev/null || echo /etc/apt/sources.list)
  mmdebstrap --quiet --variant=apt --mode=root --include=python3,python3-venv,ca-certificates \
    bookworm "$work/base.tar" "$sources"
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$work/pip.conf"
  ctr=$(buildah from scratch)
  buildah add "$ctr" "$work/base.tar" / >/dev/null
  buildah copy "$ctr" /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt >/dev/null
  buildah copy "$ctr" "$work/pip.conf" /etc/pip.conf >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
  buildah commit --quiet "$ctr" "$base" >/dev/null
  buildah rm "$ctr" >/dev/null
  ctr=""
fi

echo "image-check: building deploy/Dockerfile (gateway) on $base"
start=$SECONDS
log=$work/build.log
if ! buildah bud --isolation chroot --network host --ignorefile deploy/Dockerfile.dockerignore \
  --build-arg BASE_IMAGE="$base" -f deploy/Dockerfile -t "$image" . >"$log" 2>&1; then
  tail -30 "$log" >&2
  buildah rmi "$image" >/dev/null 2>&1 || true
  exit 1
fi
echo "image-check: built in $((SECONDS - start)) s"

ctr=$(buildah from --quiet "$image")
buildah inspect --type image "$image" >"$work/inspect.json"
python3 - "$work/inspect.json" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))["OCIv1"]["config"]
assert config["Entrypoint"] == ["kvturn"], config["Entrypoint"]
assert config["Cmd"] == ["serve", "--help"], config["Cmd"]
assert config["User"] == "10001", config["User"]
PY
run() { buildah run --isolation chroot "$ctr" -- "$@"; }
# The image's own user, entrypoint and default command.
[[ $(run id -u) == 10001 ]]
help=$(run kvturn --help)
[[ $help == *"usage: kvturn"*"{up,serve,engine,models,top}"* ]] || { echo "$help" >&2; exit 1; }
serve=$(run kvturn serve --help)
[[ $serve == *"--config"* ]] || { echo "$serve" >&2; exit 1; }
run python -P -c "import kvturn.client, kvturn.gateway.app"
echo "image-check: kvturn --help and kvturn serve --help ran in the image as uid 10001"

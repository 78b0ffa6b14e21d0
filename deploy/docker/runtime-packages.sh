#!/bin/sh
# Prints the Debian/Ubuntu packages that hold the shared libraries the given binaries load, one per
# line, so that the runtime image installs exactly those (no -dev packages, no compilers). Libraries
# of the CUDA toolkit (/usr/local/cuda*) are left out: the CUDA runtime image carries them.
#   deploy/docker/runtime-packages.sh build/bin/lossd_server build/bin/liblossd_cuda.so
set -eu
libs=""
for binary in "$@"; do
  [ -r "$binary" ] || { echo "runtime-packages.sh: cannot read $binary" >&2; exit 1; }
  libs="$libs $(ldd "$binary" | awk '$2 == "=>" && $3 ~ /^\// && $3 !~ /^\/usr\/local\/cuda/ { print $3 }')"
done

# With merged /usr a file is registered under /lib or /usr/lib, whichever its package ships, so
# each library is looked up under every spelling of its path, all in one dpkg-query call.
candidates() {
  real=$(readlink -f "$1")
  echo "$1" "$real" "/usr$1" "${1#/usr}" "${real#/usr}"
}
all=""
for lib in $libs; do all="$all $(candidates "$lib")"; done
# shellcheck disable=SC2086  # word splitting intended: one argument per path
owners=$(dpkg-query -S $all 2>/dev/null || true)   # lines "pkg:arch[, pkg2:arch]: /path"

packages=""
for lib in $libs; do
  owner=""
  for path in $(candidates "$lib"); do
    owner=$(printf '%s\n' "$owners" | awk -F ': ' -v path="$path" '$2 == path { print $1; exit }')
    [ -n "$owner" ] && break
  done
  if [ -z "$owner" ]; then
    echo "runtime-packages.sh: no package owns $lib" >&2
    exit 1
  fi
  packages="$packages $(echo "$owner" | tr ',' ' ' | sed 's/:[a-z0-9_-]*//g')"
done
for p in $packages; do echo "$p"; done | sort -u

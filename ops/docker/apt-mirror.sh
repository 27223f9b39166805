#!/usr/bin/env bash
# Print the Debian mirror this machine's apt already uses, for debootstrap.
#
#   bash ops/docker/apt-mirror.sh [SUITE]      # SUITE defaults to bookworm
#
# Reads apt's own configuration (APT_ETC, default /etc/apt): the deb822 `.sources` files
# and the one-line `sources.list` format, enabled `deb` entries only. The first URI that
# serves SUITE itself wins; failing that, the first URI whose path ends in `/debian`
# (a Debian mirror serving other suites). Security and updates archives are never picked.
# Ferry names no mirror host of its own: a machine whose apt knows no Debian mirror gets
# a clear error and sets DEBIAN_MIRROR. Exit 1 when nothing is found.
set -euo pipefail
SUITE="${1:-bookworm}"
ETC="${APT_ETC:-/etc/apt}"

entries() {  # "URI SUITE" lines, one per (uri, suite) of every enabled deb entry
  local f
  for f in "$ETC"/sources.list "$ETC"/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    # deb [options] URI SUITE COMPONENTS...
    sed -E 's/#.*//; s/\[[^]]*\]//' "$f" | awk '$1 == "deb" && NF >= 3 { print $2, $3 }'
  done
  for f in "$ETC"/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk '
      function flush(   i, j) {
        if (types ~ /(^| )deb( |$)/ && enabled != "no")
          for (i = 1; i <= nu; i++) for (j = 1; j <= ns; j++) print uris[i], suites[j]
        types = ""; enabled = ""; nu = 0; ns = 0
      }
      /^[ \t]*#/ { next }
      /^[ \t]*$/ { flush(); next }
      {
        key = tolower($1); sub(/:$/, "", key)
        if (key == "types") { $1 = ""; types = $0 }
        else if (key == "enabled") { enabled = tolower($2) }
        else if (key == "uris") { nu = 0; for (i = 2; i <= NF; i++) uris[++nu] = $i }
        else if (key == "suites") { ns = 0; for (i = 2; i <= NF; i++) suites[++ns] = $i }
      }
      END { flush() }
    ' "$f"
  done
}

found="$(entries | awk -v suite="$SUITE" '$2 == suite { print $1; exit }')"
if [ -z "$found" ]; then
  found="$(entries | awk '$1 ~ /\/debian\/?$/ { print $1; exit }')"
fi
if [ -z "$found" ]; then
  echo "apt-mirror: no Debian mirror for '$SUITE' in $ETC's sources; set DEBIAN_MIRROR" >&2
  exit 1
fi
echo "${found%/}"

#!/usr/bin/env bash
# fetch.sh URL FILE: downloads URL to FILE unless FILE is there already. The download
# goes to FILE.part first, so an interrupted one never passes for the whole file.
set -euo pipefail
url=$1
file=$2
if [ -f "$file" ]; then
    echo "$file is already there"
    exit 0
fi
mkdir -p "$(dirname "$file")"
curl -fL --retry 3 -o "$file.part" "$url"
mv "$file.part" "$file"

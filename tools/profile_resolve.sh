#!/usr/bin/env bash
# Where `lorakit train --dry-run` (the config's resolution, which every run does first) spends its time, on this
# machine: the 25 functions with the most cumulative time. Usage: tools/profile_resolve.sh CONFIG.yaml [args...]
set -euo pipefail
cfg=$1; shift
python3 -m cProfile -o /tmp/resolve.prof -m lorakit train "$cfg" --dry-run --json "$@" > /dev/null
python3 -c "import pstats; pstats.Stats('/tmp/resolve.prof').sort_stats('cumulative').print_stats(40)" \
  | grep -v "^$" | head -70

#!/usr/bin/env bash
# Where `lorakit train` spends its main thread's time (imports, the config's check, load, prepare, step 1, ...) on
# this machine: cProfile over the whole command (threads other than the main one are not counted) and Python's
# import timer. Writes PREFIX.log/.err (the run's output, JSON log lines), PREFIX.txt (the 80 functions with the
# most cumulative time, then the 30 with the most own time) and PREFIX.imports.txt (the imports of
# 50 ms or more, as a tree).
# PYTHON: the interpreter (default python3).
#   tools/profile_train.sh /tmp/prof/warm CONFIG.yaml --profile datacenter --set output.dir=/tmp/prof/run
set -uo pipefail
pre=$1; shift
mkdir -p "$(dirname "$pre")"
"${PYTHON:-python3}" -X importtime -m cProfile -o "$pre.prof" -m lorakit train "$@" --log-format json > "$pre.log" 2> "$pre.err"
echo "lorakit train exited $?" >> "$pre.log"
"${PYTHON:-python3}" - "$pre" <<'PY'
import pstats
import re
import sys

pre = sys.argv[1]
with open(pre + ".txt", "w") as f:
    stats = pstats.Stats(pre + ".prof", stream=f)
    stats.sort_stats("cumulative").print_stats(80)
    stats.sort_stats("tottime").print_stats(30)
with open(pre + ".imports.txt", "w") as f:  # -X importtime: "import time: self [us] | cumulative | <indent>name"
    for line in open(pre + ".err"):
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)", line)
        if m and int(m.group(1)) >= 50_000:  # the tree of imports that took 50 ms or more, as imported
            f.write(f"{int(m.group(1)) / 1e6:8.2f} s {m.group(2)}{m.group(3)}\n")
PY

"""GPU evidence for `lorakit doctor`'s attention choice: each SDPA backend, and PyTorch's default pick,
inside every architecture's real transformer class (full width, checkpointed, 1024²), each in its own
process (a kernel that corrupts memory takes only its own process down). Marks lorakit's choice.

    python tools/attention_in_model.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def main() -> None:
    from lorakit.hardware import attention as att
    from lorakit.models.registry import family_of_arch

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", nargs=2, metavar=("CASE", "BACKEND"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        from dataclasses import asdict

        from lorakit.hardware.attention_model import run_model_case

        backend = None if a.one[1] == "default" else a.one[1]
        print(json.dumps(asdict(run_model_case(a.one[0], backend, repeats=3))))
        return
    report = att.self_test("cuda")
    chosen = {c: report.choice[family_of_arch(c.removeprefix("model "))] for c in att.all_model_cases()}
    rows = []
    for case in att.all_model_cases():
        for backend in ("default", *att.BACKENDS):
            p = subprocess.run([sys.executable, __file__, "--one", case, backend], capture_output=True, text=True,
                               timeout=900)
            try:
                row = json.loads(p.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                tail = (p.stderr.strip().splitlines() or ["no output"])[-1][:200]
                row = {"backend": backend, "case": case, "ok": False, "ms": None, "error": f"process died: {tail}"}
            row["backend"] = backend
            row["lorakit_choice"] = backend == chosen[case]
            rows.append(row)
            print(f"{case:17s} {backend:9s} {'PASS' if row['ok'] else 'FAIL'} {row['ms'] or 0:9.2f} ms  "
                  f"{(row['error'] or '')[:90]} {'<- lorakit choice' if row['lorakit_choice'] else ''}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"self_test": report.to_dict(), "in_model": rows}, f, indent=2)


if __name__ == "__main__":
    main()

"""Retrains the suite's draft/target pair that ships in lab/specprefill_lab/data/suite-pair (fixed seeds), starting from
the shipped retrieval pair.

    .venv/bin/python lab/benchmarks/train_suite_pair.py [OUT_DIR]

Trains the draft and the target side by side, one process and one thread each (about 45 minutes on 2 cores).
Without OUT_DIR it overwrites the shipped pair. See specprefill_lab.suite_training for the recipe, and
`specprefill eval --suite --pair OUT_DIR` to evaluate the result.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

from specprefill_lab.suite import SHIPPED_SUITE_PAIR

ONE = (
    "import sys, json, torch; torch.set_num_threads(1); from pathlib import Path; "
    "from specprefill_lab.suite_training import train_suite_model; "
    "print(json.dumps({'seconds': train_suite_model(sys.argv[1], Path(sys.argv[2]))}))"
)

if __name__ == "__main__":
    if len(sys.argv) > 2:
        raise SystemExit(__doc__)
    out = Path(sys.argv[1]) if len(sys.argv) == 2 else SHIPPED_SUITE_PAIR
    out.mkdir(parents=True, exist_ok=True)
    runs = {
        name: subprocess.Popen([sys.executable, "-c", ONE, name, str(out)], stdout=subprocess.PIPE, text=True)
        for name in ("draft", "target")
    }
    results: dict[str, list[str]] = {name: [] for name in runs}

    def relay(name: str) -> None:
        for line in runs[name].stdout:
            results[name].append(line)
            print(f"[{name}] {line}", end="", flush=True)

    threads = [threading.Thread(target=relay, args=(name,)) for name in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = {}
    for name, run in runs.items():
        if run.wait() != 0:
            raise SystemExit(f"training the {name} failed")
        seconds[name] = json.loads(results[name][-1])["seconds"]
    from specprefill_lab.suite_training import write_provenance

    write_provenance(out, seconds)
    print(f"wrote {out} ({', '.join(f'{n} {s / 60:.0f} min' for n, s in seconds.items())})")

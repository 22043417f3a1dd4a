"""How long each command takes to answer, process start included (issue 25: "every command takes
5-7 s to start"): ``cachescore --help``, ``status``, ``validate``, ``export``, ``compare`` and a
``run`` refused because another run holds the store's lock, on a scored store.

    python benchmarks/cli_startup.py                 # scores the demo job into a temporary folder first
    python benchmarks/cli_startup.py --job JOB.toml  # an already scored job

Each command runs ``--repeat`` times as a fresh ``python -m cachescore.cli`` process; the median wall
time is printed, with the import time of ``cachescore.cli`` itself (``python -X importtime``) and
the heavy libraries a plain ``import cachescore.cli`` pulls in (none of scikit-learn, scipy,
distributed, matplotlib is expected).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _demo_job(workdir: Path) -> Path:
    text = (REPO / "jobs" / "demo.toml").read_text(encoding="utf-8")
    text = text.replace('cache = "../demo-cache"', f'cache = "{workdir / "cache"}"').replace(
        'store = "../results/demo"', f'store = "{workdir / "store"}"')
    job = workdir / "demo.toml"
    job.write_text(text, encoding="utf-8")
    subprocess.run([sys.executable, "-m", "cachescore.cli", "run", "-q", str(job)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return job


def _wall(args: list[str], repeat: int) -> tuple[float, int]:
    times, rc = [], 0
    for _ in range(repeat):
        t = time.perf_counter()
        rc = subprocess.run([sys.executable, "-m", "cachescore.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL).returncode
        times.append(time.perf_counter() - t)
    return statistics.median(times), rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", type=Path, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        job = args.job or _demo_job(Path(tmp))
        text = job.read_text(encoding="utf-8")
        store = Path(re.search(r'^store = "([^"]+)"', text, re.M).group(1))
        store = store if store.is_absolute() else (job.parent / store).resolve()
        imp = subprocess.run([sys.executable, "-X", "importtime", "-c",
                              "import sys, cachescore.cli; print(sorted(m for m in ('sklearn', 'scipy', "
                              "'distributed', 'matplotlib') if m in sys.modules))"],
                             capture_output=True, text=True, check=True)
        own = [int(line.split("|")[1]) for line in imp.stderr.splitlines() if line.rstrip().endswith("| cachescore.cli")]
        print(f"import cachescore.cli: {own[0] / 1e6:.2f} s (cumulative, -X importtime); heavy libraries loaded: "
              f"{imp.stdout.strip()}")
        rows = [("--help", ["--help"]), ("status", ["status", str(job)]), ("validate", ["validate", str(job)]),
                ("export", ["export", str(job), "-o", str(Path(tmp) / "x.parquet")]),
                ("compare", ["compare", str(job), "enc0", "enc1"])]
        for name, cmd in rows:
            seconds, rc = _wall(cmd, args.repeat)
            print(f"{name:>24}: {seconds:5.2f} s (exit {rc})")
        lock = store / "run.lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)  # another run holds the store
        try:
            seconds, rc = _wall(["run", str(job)], args.repeat)
            print(f"{'run (store locked)':>24}: {seconds:5.2f} s (exit {rc}; refused before any cluster)")
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the test suite's time goes: runs pytest (the whole suite, or the paths given) with per-phase durations and
prints the slowest modules, each with its tests' set-up (swarms starting), bodies and teardown (swarms stopping).

`python bench/test_times.py [--top 10] [pytest arguments...]`, e.g. `python bench/test_times.py tests/integration`.
The run's own pass/fail line is printed too; the exit status is pytest's.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass

# "12.34s setup    tests/integration/test_api.py::test_x[param]" as pytest's --durations prints it
DURATION = re.compile(r"^\s*([0-9.]+)s\s+(setup|call|teardown)\s+(\S+?)::")


@dataclass
class Module:
    setup: float = 0.0
    call: float = 0.0
    teardown: float = 0.0
    tests: int = 0

    @property
    def total(self) -> float:
        return self.setup + self.call + self.teardown


def modules(output: str) -> dict[str, Module]:
    found: defaultdict[str, Module] = defaultdict(Module)
    for line in output.splitlines():
        match = DURATION.match(line)
        if match:
            seconds, phase, path = float(match.group(1)), match.group(2), match.group(3)
            module = found[path]
            setattr(module, phase, getattr(module, phase) + seconds)
            module.tests += phase == "call"
    return dict(found)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=10, help="modules to list")
    args, pytest_args = parser.parse_known_args()
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "--durations=0",
               "--durations-min=0", *pytest_args]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, check=False)
    found = modules(run.stdout)
    total = sum(module.total for module in found.values())
    print(f"{'module':<52} {'tests':>5} {'set-up':>8} {'bodies':>8} {'teardown':>8} {'total':>8}")
    for path, module in sorted(found.items(), key=lambda item: -item[1].total)[: args.top]:
        print(f"{path:<52} {module.tests:>5} {module.setup:>7.1f}s {module.call:>7.1f}s {module.teardown:>7.1f}s "
              f"{module.total:>7.1f}s")  # fmt: skip
    setup = sum(module.setup + module.teardown for module in found.values())
    print(f"all {len(found)} modules: {total:.0f} s, of which set-up and teardown {setup:.0f} s")
    for line in run.stdout.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            print(line)
    summary = [line for line in run.stdout.splitlines() if " passed" in line or " failed" in line]
    print(summary[-1] if summary else run.stdout[-2000:] + run.stderr[-2000:])
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())

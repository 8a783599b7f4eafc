"""Run a command and measure its own peak RSS.

A process forked from pytest inherits pytest's high-water mark (Linux records the pre-exec peak in
the child's ``ru_maxrss``), so a child of a big test process looks big. A small fresh Python process
runs the command instead, and reports its child's ``RUSAGE_CHILDREN`` peak: the command's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_WRAPPER = """
import json, resource, subprocess, sys
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(json.dumps({"rc": r.returncode, "out": r.stdout, "err": r.stderr,
                  "rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def run_measured(argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None,
                 timeout: float = 300) -> dict[str, Any]:
    """``argv`` in a subprocess: ``rc``, ``out``, ``err``, ``rss`` (its own peak, bytes) and ``seconds``."""
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-c", _WRAPPER, *argv], capture_output=True, text=True, env=env, cwd=cwd,
                       timeout=timeout)
    result: dict[str, Any] = json.loads(r.stdout)
    result["seconds"] = time.monotonic() - start
    return result

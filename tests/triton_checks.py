"""A Triton check script run in a process of its own: in Triton's interpreter on the CPU
(TRITON_INTERPRET=1 must be set before Triton is imported) or on CUDA."""

import os
import subprocess
import sys


def run_check(check: str, *, interpreted: bool, **values) -> None:
    """Run `check` formatted with `values` in a fresh Python; it must exit cleanly and print "ok" first."""
    env = {**os.environ, "TRITON_INTERPRET": "1"} if interpreted else dict(os.environ)
    result = subprocess.run([sys.executable, "-c", check.format(**values)], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0 and result.stdout.startswith("ok"), result.stderr[-2000:]

"""Troubleshooting: mp.spawn from a notebook fails ("Can't get attribute 'worker'").

mp.spawn starts fresh Python processes, and each must find the function it is to run by
importing the module that defined it. A function defined in a notebook cell (or in `python -c`)
lives in a __main__ module that has no file, so the new processes cannot import it and die at
once. The fix the lessons' notebooks use: put the code in a .py file, with the
`if __name__ == "__main__":` guard, and run that file as a subprocess from the notebook. This
runs a notebook-like cell with `python -c` (the same __main__ without a file, and the same
error, as in Jupyter), then the fix. See TROUBLESHOOTING.md.

    python troubleshooting/notebook_spawn.py
"""

import os
import subprocess
import sys
import tempfile

CELL = """\
import torch.multiprocessing as mp

def worker(rank):
    print(f"hello from rank {rank}", flush=True)

"""
SPAWN = "mp.spawn(worker, nprocs=2)\n"
GUARDED = 'if __name__ == "__main__":\n    mp.spawn(worker, nprocs=2)\n'


def run(argv):
    # Bounded: the failing processes die within seconds; nothing here may wait forever.
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def main():
    cell = run([sys.executable, "-c", CELL + SPAWN])
    errors = [line for line in cell.stderr.splitlines()
              if line.startswith(("AttributeError", "torch.multiprocessing"))]
    print(f"The cell, run like a notebook's (exit code {cell.returncode}), ends with:")
    for line in dict.fromkeys(errors):  # each distinct line once, in order
        print(f"  {line}")
    if "Can't get attribute 'worker'" in cell.stderr:
        print("symptom: the new processes cannot find worker, defined in a __main__ without "
              "a file")

    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "spawn_workers.py")
        with open(script, "w") as f:
            f.write(CELL + GUARDED)
        # In a notebook: subprocess.run([sys.executable, "spawn_workers.py"]), or !python ...
        fixed = run([sys.executable, script])
    hellos = sorted(line for line in fixed.stdout.splitlines() if line.startswith("hello"))
    print(f"The same code as a file with the guard, run as a subprocess (exit code "
          f"{fixed.returncode}): {'; '.join(hellos)}")
    if fixed.returncode == 0 and len(hellos) == 2:
        print("fix: both ranks ran")


if __name__ == "__main__":
    main()

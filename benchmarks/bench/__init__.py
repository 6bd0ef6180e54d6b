"""benchmarks/scaling.py's parts, one file per job, in the order a run uses them:

    flags.py   the flags, their defaults for the device at hand, and one-line errors
    plan.py    every case of the run, one planner per family, grouped by world size
    cases.py   a case built on a rank: the models, DDP and lessons 07-10 around them
    ranks.py   the ranks of each world size, measuring their cases in rounds
    rows.py    each case's row, the speed-ups across rows, the files, the noise check
    report.py  the tables, the sentences that read them, and scaling.png
"""

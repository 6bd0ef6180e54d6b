import pytest

from helpers import run_lesson


@pytest.fixture(scope="session")
def lesson_run(tmp_path_factory):
    """run(lesson, *args, patch=None) -> (finished process, out_dir), each distinct run once.

    Several tests look at the same run from different sides; launching it once keeps the suite
    fast on a 2-core machine."""
    cache = {}

    def run(lesson, *args, patch=None, env=None):
        key = (lesson, tuple(map(str, args)), patch, tuple(sorted((env or {}).items())))
        if key not in cache:
            out_dir = tmp_path_factory.mktemp(lesson)
            result = run_lesson(lesson, *args, "--out-dir", out_dir, patch=patch, env=env)
            cache[key] = (result, out_dir)
        return cache[key]

    return run

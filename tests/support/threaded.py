"""Run a test's worker in several threads at once and fail with every worker's error."""
import threading


def run_in_threads(worker, args_per_thread):
    """Start ``worker(*args)`` for each entry of ``args_per_thread``, join all, raise on errors."""
    errors = []

    def guarded(*args):
        try:
            worker(*args)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=tuple(args)) for args in args_per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]

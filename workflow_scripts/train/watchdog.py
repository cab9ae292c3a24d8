"""The end of a training job: a rank that does not end after training says where it hangs, and ends itself.

Standard library only: it runs on the way out, whatever state torch and the process group are in.
"""

import faulthandler
import os
import sys
import threading

EXIT_WATCHDOG_S = 120  # a rank still alive this long after training ended says where it hangs, and ends
_KEPT: list = []  # keep_until_exit's


def keep_until_exit(objects) -> None:
    """Keep ``objects`` (a finished rank's model, optimizer, process group, data) referenced until the process ends by
    os._exit, so that none of their destructors runs: a forked rank returns to torchrun's code, and tearing down a
    DDP rank's objects there, with the GIL held, once waited on a thread that waited for the GIL (the job's stacks,
    dumped by exit_watchdog: the main thread at main()'s return, a native thread with no Python frame)."""
    _KEPT.append(objects)


def exit_watchdog(seconds: float = EXIT_WATCHDOG_S) -> threading.Event:
    """Armed once training has ended and its last checkpoint is committed: a rank still alive ``seconds`` later prints
    one line and every thread's stack, then ends itself, with 0 once the returned event is set (every rank passed the
    final barrier: everything is on disk), else 1 (its retry resumes from that checkpoint). A hang in the process
    group's teardown or at interpreter exit (a non-daemon thread, a native pool) would otherwise hold the job and its
    GPUs until the time limit: CI saw a resumed run's ranks alive 10 minutes after their train_state.json. A hang
    that holds the GIL gets faulthandler's own timer, 30 s later, which dumps and exits 1."""
    done = threading.Event()
    rank = os.environ.get("RANK", "0")

    def fire() -> None:
        code = 0 if done.is_set() else 1
        where = "after the final barrier: everything is on disk" if code == 0 else "before the final barrier"
        print(f"train: rank {rank} still running {seconds:.0f} s after training ended ({where}); its threads follow, "
              f"then exit {code}", file=sys.stderr, flush=True)  # fmt: skip
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True  # never waited for at exit
    timer.start()
    faulthandler.dump_traceback_later(seconds + 30, exit=True)
    return done

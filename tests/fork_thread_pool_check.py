"""Forks of a process that set torch's thread count, each loading tensors from a thread pool as transformers 5 does
(test_ranks.py): `python fork_thread_pool_check.py FORKS fresh|as-forked` prints how many forks failed."""

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from workflow_scripts.train import ranks


def convert(_: int) -> torch.Tensor:
    return torch.randn(64, 64).to(dtype=torch.bfloat16)


def child(fresh: bool) -> int:
    if fresh:
        ranks.fresh_thread_pool()
    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(convert, range(16)))
    except RuntimeError:
        return 3
    return 0


def main() -> None:
    forks, mode = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(2)
    (torch.randn(256, 256) @ torch.randn(256, 256)).sum()  # the parent's pool in use, as the launcher's
    failed = 0
    for _ in range(forks):
        pid = os.fork()
        if pid == 0:
            os._exit(child(mode == "fresh"))
        failed += os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0
    print(failed)


if __name__ == "__main__":
    main()

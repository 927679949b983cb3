"""Worker program for tests/test_exits.py: holds its monitoring mailbox as a real worker does.

Usage:
    mailbox_worker.py DIR HOW    create /dynamix.<DYNAMIX_JOB_ID>.<rank>, write DIR/<rank>.job
                                 (the job id), wait for every rank's file, then by HOW:
                                 `sleep` (until stopped), `exit` (0, closing the mailbox),
                                 `sigkill` (rank 1 kills itself; the others sleep)
"""

import os
import signal
import sys
import time

from dynamix_byteps.control.mailbox import Mailbox, mailbox_name


def main(folder: str, how: str) -> int:
    rank = int(os.environ["DYNAMIX_RANK_OFFSET"]) + int(os.environ["BYTEPS_LOCAL_RANK"])
    size = int(os.environ["DYNAMIX_SIZE"])
    job = os.environ["DYNAMIX_JOB_ID"]
    box = Mailbox.create(mailbox_name(job, rank))
    with open(os.path.join(folder, f"{rank}.job.tmp"), "w") as f:
        f.write(job)
    os.replace(os.path.join(folder, f"{rank}.job.tmp"), os.path.join(folder, f"{rank}.job"))
    while sum(1 for name in os.listdir(folder) if name.endswith(".job")) < size:
        time.sleep(0.05)
    if how == "exit":
        box.close()
        return 0
    if how == "sigkill" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

"""Run a command under a unit's sandbox pieces that need no systemd: `python3 seccomp_exec.py SPEC -- CMD...`, SPEC a
JSON object {"allow": [syscalls], "errno": 1, "mdwe": false}. Loads a seccomp allow list like systemd's
SystemCallFilter= (native architecture only, other calls fail with errno), optionally refuses write+execute
memory like MemoryDenyWriteExecute= (prctl PR_SET_MDWE, Linux >= 6.3), then execs CMD. Run by Debian's
/usr/bin/python3 (its python3-seccomp module); the filter is inherited by CMD and everything it starts."""

import ctypes
import json
import os
import sys

import seccomp

PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1
EXIT_NO_MDWE = 77  # the kernel has no PR_SET_MDWE: the caller skips


def main() -> None:
    spec = json.loads(sys.argv[1])
    command = sys.argv[sys.argv.index("--") + 1:]
    if spec.get("mdwe"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) != 0:
            sys.exit(EXIT_NO_MDWE)
    if spec.get("allow") is not None:
        f = seccomp.SyscallFilter(defaction=seccomp.ERRNO(spec.get("errno", 1)))
        for name in spec["allow"]:
            try:
                f.add_rule(seccomp.ALLOW, name)
            except (RuntimeError, ValueError):
                pass  # a name systemd lists for another kernel or architecture
        f.load()
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()

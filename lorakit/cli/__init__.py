"""The `lorakit` command line: thin commands over library functions."""

import time

STARTED = time.monotonic()  # when the command began (its log lines count from here)

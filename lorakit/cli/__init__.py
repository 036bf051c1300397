"""The `lorakit` command line: thin commands over library functions."""

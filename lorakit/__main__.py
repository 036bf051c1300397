"""`python -m lorakit` runs the CLI."""

from lorakit.cli.entry import main

if __name__ == "__main__":
    main()

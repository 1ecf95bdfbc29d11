"""`python -m specloop`: the specloop command line, exiting with its code."""
import sys

from specloop.services.cli.main import main

if __name__ == "__main__":
    sys.exit(main())

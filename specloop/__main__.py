"""`python -m specloop`: the specloop command line."""
from specloop.services.cli.main import main

if __name__ == "__main__":
    main()

"""`python -m jspec serve|generate`: the server and the command-line generator."""

from jspec.cli import main

if __name__ == "__main__":  # the engine process, started by "spawn", imports this module too
    main()

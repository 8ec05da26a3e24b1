import sys

from .cli import main

status = main()
# A KeyboardInterrupt that passed through a string ``exec`` (Dynamo and Inductor run generated
# code so) marks the process as stopped by Ctrl-C in CPython, even when the benchmark caught it
# and reported what it measured; under ``python -m`` CPython then ends the process by SIGINT
# instead of with ``status``. Each string ``exec`` clears that mark first: this one runs nothing.
exec("")
sys.exit(status)

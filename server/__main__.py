"""``python -m dllm.server --model DIR`` (the same as ``dllm serve``)."""

import sys

from dllm.server.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))

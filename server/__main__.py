"""``python -m dllm.server --model DIR`` (the same as ``dllm serve``)."""

import sys

from dllm.server.launch import main

sys.exit(main())

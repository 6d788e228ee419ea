import sys

from vllm_aio.cli import main

sys.exit(main())
